"""The step-time model's own terms (optimus/plan/step_time.py) priced by hand: what activation checkpointing runs
again of the FLOPs, the pipeline's fill and drain over its sends, each op class at its own efficiency."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import Cluster
from optimus.plan.efficiency import Efficiency
from optimus.plan.memory import ModelShape
from optimus.plan.step_time import step_time
from tests.helpers.plan import toy_cluster

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
HALF = Efficiency(0.5, 0.5, 0.5, loss_head=0.5)  # every FLOP class at half of peak


def _toy(**changes) -> Cluster:
    return toy_cluster(**changes)


def _layout(ranks: int, *overrides: str, preset: str = "mula-tiny-dense"):
    """The tiny model at 8 x 4096 tokens a micro-batch in fp32: compute bound (no roofline term binds)."""
    config = load_config(CONFIGS / f"{preset}.yaml", ["--train.dtype=fp32", "--train.micro_batch_size=8",
                                                      "--train.seq_len=4096", *overrides])
    layout = validate_layout(config, ranks)
    return layout, ModelShape.of(layout.config)


def _compute(ranks: int, *overrides: str, cluster: Cluster | None = None) -> float:
    layout, shape = _layout(ranks, *overrides)
    return step_time(layout.config, layout.dims, shape, cluster or _toy(), HALF,
                     layout.batch.micro_batches).parts["compute"]


def test_checkpointing_runs_a_third_of_the_training_flops_again_for_the_classes_it_recomputes():
    """A recomputed forward is a third of training's 6 N + 12 L d S FLOPs a token (forward 2, backward 4): full
    checkpointing adds a third of the blocks' projections, MLP and attention scores, never the LM head's;
    selective over the MLP a third of its matrices alone (and of the norms', which the MLP class carries)."""
    layout, shape = _layout(1)
    m, tokens = layout.config.model, 8 * 4096
    seconds_per_flop = tokens / (0.5 * _toy().peak_flops("fp32"))
    none = _compute(1, "--train.activation_checkpointing=none")
    layers = shape.n_layers
    blocks = 6 * layers * (shape.block_tp_split + shape.block_replicated) + 12 * layers * m.d_model * 4096
    full = _compute(1, "--train.activation_checkpointing=full")
    assert full - none == pytest.approx(blocks / 3 * seconds_per_flop, rel=1e-9)
    mlp = 6 * layers * (shape.block_tp_split - shape.block_attention + shape.block_replicated)
    selective = _compute(1, "--train.activation_checkpointing=selective", "--train.recompute=[mlp]")
    assert selective - none == pytest.approx(mlp / 3 * seconds_per_flop, rel=1e-9)


def test_filling_and_draining_the_pipe_waits_for_a_send_each_way_per_stage_boundary():
    """pp stages have pp - 1 boundaries, and the first micro-batch's activations cross each forward and its
    gradients each backward before the steady state: 2 (pp - 1) sends of a micro-batch's activations, which no
    compute hides (the steady state's sends hide behind the next micro-batch's compute). Two links that differ
    only in bandwidth differ in the step by those sends' bytes alone, beside the step's small collectives."""
    layout, shape = _layout(4, "--parallel.pp=4", "--train.global_batch_size=32")
    act_bytes = 8 * 4096 * layout.config.model.d_model * 4

    def step_without_small_collectives(gb_s: float) -> float:
        priced = step_time(layout.config, layout.dims, shape, _toy(intra_node_gb_s=gb_s), HALF,
                           layout.batch.micro_batches)
        assert priced.parts["pp_p2p"] == 0.0  # the steady state's sends hidden
        return priced.step_s - priced.parts["step_collectives"]

    slower = step_without_small_collectives(10) - step_without_small_collectives(100)
    assert slower == pytest.approx(2 * (4 - 1) * (act_bytes / 10e9 - act_bytes / 100e9), rel=1e-6)


INTERLEAVED = ["--parallel.pp_schedule=interleaved_1f1b", "--parallel.pp_virtual_stages=2"]


@pytest.mark.parametrize("schedule", [[], INTERLEAVED], ids=["1f1b", "interleaved"])
def test_where_nothing_hides_the_sends_each_micro_batch_waits_for_two_per_virtual_stage(schedule):
    """Each micro-batch sends its activations forward and their gradients back once per virtual stage a rank holds
    (2 v sends); on links that cannot run beside compute (`here`'s gloo on the ranks' own cores) each one shows."""
    layout, shape = _layout(2, "--parallel.pp=2", "--train.global_batch_size=32", *schedule)
    virtual = layout.config.parallel.pp_virtual_stages
    cluster = _toy(comm_overlaps_compute=False)
    priced = step_time(layout.config, layout.dims, shape, cluster, HALF, layout.batch.micro_batches)
    one_send = 5e-6 + 8 * 4096 * layout.config.model.d_model * 4 / 100e9
    assert priced.parts["pp_p2p"] == pytest.approx(layout.batch.micro_batches * 2 * virtual * one_send, rel=1e-9)


def test_only_the_last_stage_pays_the_vocab_parallel_losss_passes_over_its_logits(monkeypatch):
    """The vocab-parallel loss runs on the stage that holds the LM head: its passes over the logits lengthen every
    micro-batch of that stage, not the fill and drain through the stages without the head."""
    import optimus.plan.step_time as st

    layout, shape = _layout(4, "--parallel.tp=2", "--parallel.pp=2", "--train.global_batch_size=32")

    def parts() -> dict:
        return step_time(layout.config, layout.dims, shape, _toy(), HALF, layout.batch.micro_batches).parts
    with_passes = parts()
    monkeypatch.setattr(st, "VOCAB_PARALLEL_EXTRA_BYTES", 0)
    without = parts()
    assert with_passes["memory_bound"] > without["memory_bound"]
    assert with_passes["bubble"] == pytest.approx(without["bubble"], rel=1e-12)


def test_a_gemm_class_takes_at_least_its_weights_three_passes_over_hbm_of_the_share_a_rank_holds():
    """Roofline: a micro-batch reads each weight in its forward, again for the input gradient, and writes the
    weight gradient (3 passes); on memory this slow every GEMM class is bound by that, each over what a tp rank
    holds: its 1/tp of the projections and the LM head, the norms and router whole, 1/(ep tp) of the experts."""
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=fp32", "--train.micro_batch_size=1",
                                                           "--train.seq_len=128", "--train.global_batch_size=2",
                                                           "--parallel.tp=2"])
    layout = validate_layout(config, 2)
    shape, m, cluster = ModelShape.of(layout.config), layout.config.model, _toy(hbm_gb_s=1)
    priced = step_time(layout.config, layout.dims, shape, cluster, HALF, layout.batch.micro_batches)
    layers, hbm = shape.n_layers, 1e9
    dense = layers * (shape.block_tp_split / 2 + shape.block_replicated) + shape.head / 2
    experts = layers * shape.block_experts / 2
    attention = 128 * 12 * layers * m.d_model * 128 / 2 / (0.5 * cluster.peak_flops("fp32"))
    per_micro_batch = 3 * 4 * dense / hbm + 3 * 4 * experts / hbm + attention
    assert priced.parts["compute"] == pytest.approx(layout.batch.micro_batches * per_micro_batch, rel=1e-9)


def test_selective_recompute_of_the_moe_runs_its_router_and_experts_forward_again():
    """Selective checkpointing over the MoE feed-forward (recompute=[moe]) runs a third of the MLP class's training
    FLOPs (the block's non-attention matrices and its norms and router) and a third of the active experts' (6 x
    experts x top_k / n_experts a token) again; nothing of attention."""
    moe = ["--train.micro_batch_size=8", "--train.seq_len=4096", "--train.dtype=fp32", "--train.global_batch_size=8"]
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", [*moe, "--train.activation_checkpointing=none"])
    layout = validate_layout(config, 1)
    shape, m = ModelShape.of(layout.config), layout.config.model

    def compute(*overrides: str) -> float:
        priced = validate_layout(load_config(CONFIGS / "mula-tiny-moe.yaml", [*moe, *overrides]), 1)
        return step_time(priced.config, priced.dims, shape, _toy(), HALF, 1).parts["compute"]
    layers = shape.n_layers
    mlp = 6 * layers * (shape.block_tp_split - shape.block_attention + shape.block_replicated)
    experts = 6 * layers * shape.block_experts * m.top_k / m.n_experts
    seconds_per_flop = 8 * 4096 / (0.5 * _toy().peak_flops("fp32"))
    again = compute("--train.activation_checkpointing=selective", "--train.recompute=[moe]") - \
        compute("--train.activation_checkpointing=none")
    assert again == pytest.approx((mlp + experts) / 3 * seconds_per_flop, rel=1e-6)


def test_each_recomputed_forward_launches_the_forwards_operators_once_more():
    """Operator launches a micro-batch: the forward's (84 a dense block, 23 for embedding, final norm and loss head),
    twice that in the backward, and once more where activation checkpointing recomputes the forward: 4 x under full
    checkpointing, eager, at op_overhead_us each."""
    layout, shape = _layout(1, "--train.activation_checkpointing=full", "--train.global_batch_size=8")
    overhead = Efficiency(0.5, 0.5, 0.5, loss_head=0.5, op_overhead_us=10.0)
    priced = step_time(layout.config, layout.dims, shape, _toy(), overhead, layout.batch.micro_batches)
    forward = 84 * shape.n_layers + 23
    assert priced.parts["op_overhead"] == pytest.approx(layout.batch.micro_batches * 10e-6 * forward * 4, rel=1e-9)


def test_recomputing_the_mlp_alone_reads_the_dense_weights_a_fourth_time():
    """Roofline under selective checkpointing of the MLP: the recomputed forward reads the dense matrices once more,
    4 passes of fp32 over the rank's dense weights (blocks and head) where memory binds; attention, not
    recomputed, keeps its training FLOPs alone."""
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.micro_batch_size=1",
                                                             "--train.seq_len=128", "--train.global_batch_size=1",
                                                             "--train.activation_checkpointing=selective",
                                                             "--train.recompute=[mlp]"])
    layout = validate_layout(config, 1)
    shape, m, cluster = ModelShape.of(layout.config), layout.config.model, _toy(hbm_gb_s=1)
    priced = step_time(layout.config, layout.dims, shape, cluster, HALF, layout.batch.micro_batches)
    layers = shape.n_layers
    dense = layers * (shape.block_tp_split + shape.block_replicated) + shape.head
    attention = 128 * 12 * layers * m.d_model * 128 / (0.5 * cluster.peak_flops("fp32"))
    assert priced.parts["compute"] == pytest.approx(4 * 4 * dense / 1e9 + attention, rel=1e-9)


def test_a_compiled_block_moves_the_fused_bytes_and_launches_a_tenth_of_its_operators():
    """Under train.compile each block's elementwise work moves the fused count (eager_memory_traffic does not apply:
    per token and block 4h + 4 (h + kv) + 6h + 3f elements, 3 passes without recompute, fp32) at memory_bound of
    HBM, and launches COMPILED_OPERATOR_SHARE (0.1) of its 84 operators; the root's 23 stay eager."""
    layout, shape = _layout(1, "--train.compile=true", "--train.global_batch_size=8")
    costly = Efficiency(0.5, 0.5, 0.5, memory_bound=0.5, loss_head=0.5, op_overhead_us=10.0,
                        eager_memory_traffic=3.0)
    priced = step_time(layout.config, layout.dims, shape, _toy(), costly, layout.batch.micro_batches)
    m, layers, micro_batches = layout.config.model, shape.n_layers, layout.batch.micro_batches
    h, kv, f = m.d_model, m.kv_heads * m.head_dim, m.ffn_hidden
    per_token_layer = 4 * h + 4 * (h + kv) + 6 * h + 3 * f
    memory = 8 * 4096 * layers * per_token_layer * 4 * 3 / (3000e9 * 0.5)
    assert priced.parts["memory_bound"] == pytest.approx(micro_batches * memory, rel=1e-9)
    launches = (0.1 * 84 * layers + 23) * 3
    assert priced.parts["op_overhead"] == pytest.approx(micro_batches * 10e-6 * launches, rel=1e-9)
