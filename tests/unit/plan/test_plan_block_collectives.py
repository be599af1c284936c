"""A block's collectives per micro-batch (optimus/plan/block_collectives.py) priced by hand: what each checkpointing
mode runs again, tensor parallelism's calls, expert parallelism's exchanges. (The replayed counts against a real
backward on gloo: tests/distributed/test_checkpointing_collectives.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.block_collectives import replayed_collectives, tensor_parallel_time
from optimus.plan.comms import all_reduce_time, group_link
from tests.helpers.plan import toy_cluster

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TOY = toy_cluster()


def _tp2(*overrides: str):
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.micro_batch_size=2",
                                                              "--train.seq_len=128", "--parallel.tp=2", *overrides])
    return validate_layout(config, 2)


def test_recomputing_the_norms_alone_runs_qk_norms_two_all_reduces_again():
    """QK-norm's q and k norms all-reduce each token's sum of squares over tp (fp32, 4 bytes a token); selective
    checkpointing of the norms recomputes them, so each layer's backward runs those two all-reduces again, as a
    recomputed attention does, and nothing else of tp's."""
    plain, norms = _tp2(), _tp2("--train.activation_checkpointing=selective", "--train.recompute=[norms]")
    assert plain.config.model.qk_norm
    layers, tokens = plain.config.model.n_layers, 2 * 128
    act_bytes = tokens * plain.config.model.d_model * 4

    def tp_seconds(layout) -> float:
        return tensor_parallel_time(layout.config, layout.dims, TOY, layers, act_bytes,
                                    replayed_collectives(layout.config))
    one_all_reduce = all_reduce_time(group_link(plain.dims, ("tp",), TOY), 4 * tokens)
    assert tp_seconds(norms) - tp_seconds(plain) == pytest.approx(layers * 2 * one_all_reduce, rel=1e-9)


def test_a_micro_batchs_tensor_parallel_calls_are_counted_and_sized_as_the_model_runs_them():
    """Per block an all-gather and a reduce-scatter of the activations around attention and around the MLP, each
    mirrored in the backward (4 of each), and QK-norm's two fp32 all-reduces of a value a token, forward and
    backward; the root's: the embedding's scatter and its gather back, the LM head's gather and its scatter back,
    and the loss's gathered [2, rows] fp32 statistics of every tp rank per chunk of rows."""
    from optimus.ops.cross_entropy import DEFAULT_CHUNK_ROWS
    from optimus.plan.comms import ring_time

    layout = _tp2()
    layers, tokens, tp = layout.config.model.n_layers, 2 * 128, 2
    act_bytes = tokens * layout.config.model.d_model * 4
    link = group_link(layout.dims, ("tp",), TOY)
    gather, scatter = ring_time(link, act_bytes), ring_time(link, act_bytes, "reduce_scatter")
    rows = min(DEFAULT_CHUNK_ROWS, tokens)
    loss_statistics = -(-tokens // rows) * ring_time(link, tp * 2 * 4 * rows)
    expected = (layers * (4 * (gather + scatter) + 2 * 2 * all_reduce_time(link, 4 * tokens))
                + 2 * (gather + scatter) + loss_statistics)
    again = replayed_collectives(layout.config)
    priced = tensor_parallel_time(layout.config, layout.dims, TOY, layers, act_bytes, again)
    assert priced == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("model, mode, recompute, replayed", [
    # a MoE block's closing reduce-scatter follows the exchange: its recompute stops before it
    ("mula-tiny-moe", "full", "[moe]", (2, 1, 2, "all")), ("mula-tiny-dense", "full", "[mlp]", (2, 2, 2, "all")),
    ("mula-tiny-moe", "selective", "[attention]", (0, 0, 2, "none")),
    ("mula-tiny-moe", "selective", "[moe]", (0, 0, 0, "all")),
    ("mula-tiny-dense", "selective", "[mlp]", (0, 0, 0, "none")),
    ("mula-tiny-moe", "selective_ops", "[moe]", (2, 0, 0, "gather")),
    ("mula-tiny-moe", "none", "[moe]", (0, 0, 0, "none")),
])
def test_each_checkpointing_mode_runs_again_what_it_recomputes(model, mode, recompute, replayed):
    config = load_config(CONFIGS / f"{model}.yaml", [f"--train.activation_checkpointing={mode}",
                                                     f"--train.recompute={recompute}"])
    again = replayed_collectives(config)
    assert (again.tp_gathers, again.tp_scatters, again.qk_norm, again.ep) == replayed


def test_fsdp_reduces_each_norms_gradient_over_tp_in_every_micro_batch():
    """Each block's two norms and the final norm: 2 x 4 + 1 = 9 all-reduces on the 4-layer tiny model at dp 2 x
    tp 2 under FSDP; none under zero1 (one flat sum a step), without tp, or without data parallelism."""
    from optimus.plan.block_collectives import norm_gradient_reduces

    def count(world: int, *overrides: str) -> int:
        layout = validate_layout(load_config(CONFIGS / "mula-tiny-dense.yaml", list(overrides)), world)
        return norm_gradient_reduces(layout.config, layout.dims, 4)

    assert count(4, "--parallel.tp=2", "--parallel.dp_shard=2") == 9
    assert count(4, "--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.shard_mode=zero1") == 0
    assert count(2, "--parallel.tp=2") == 0 and count(2, "--parallel.dp_shard=2") == 0


def test_without_a_pipeline_the_priced_stage_also_runs_the_embeddings_gather_and_scatter():
    """The last stage holds the head; only without a pipeline does it hold the embedding too, whose output is
    reduce-scattered to sequence shards and its gradient all-gathered back: one more gather and scatter."""
    from optimus.plan.comms import ring_time

    alone = _tp2()
    piped = validate_layout(load_config(CONFIGS / "mula-tiny-dense.yaml", [
        "--train.dtype=fp32", "--train.micro_batch_size=2", "--train.seq_len=128", "--parallel.tp=2",
        "--parallel.pp=2"]), 4)
    act_bytes = 2 * 128 * alone.config.model.d_model * 4
    link = group_link(alone.dims, ("tp",), TOY)
    assert link == group_link(piped.dims, ("tp",), TOY)
    seconds = [tensor_parallel_time(layout.config, layout.dims, TOY, 2, act_bytes, replayed_collectives(layout.config))
               for layout in (alone, piped)]
    assert seconds[0] - seconds[1] == pytest.approx(
        ring_time(link, act_bytes) + ring_time(link, act_bytes, "reduce_scatter"), rel=1e-9)


def test_the_allgather_dispatch_gathers_every_ranks_tokens_and_routing():
    """ep 4 ranks of 10 tokens, top-2: 80 token copies gathered with their fp32 weights and int64 expert ids, and one
    int64 token count a rank."""
    from optimus.plan.block_collectives import allgather_exchange_bytes

    assert allgather_exchange_bytes(4, 1000.0, 10, 2) == {"tokens": 4000.0, "router_weights": 320,
                                                          "expert_ids": 640, "token_counts": 32}


def test_the_all_to_all_dispatch_first_exchanges_each_experts_row_count():
    """Per MoE layer: the forward's int64 row count of each of the 16 experts, then dispatch and combine forward and
    backward (each top-k copies of the rank's tokens); without recompute nothing runs again."""
    from optimus.plan.block_collectives import expert_parallel_time
    from optimus.plan.comms import all_to_all_time

    layout = validate_layout(load_config(CONFIGS / "mula-tiny-moe.yaml", [
        "--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.ep_dispatch=all_to_all"]), 2)
    config, dims = layout.config, layout.dims
    link = group_link(dims, ("ep",), TOY)
    exchange = all_to_all_time(link, 1000.0 * config.model.top_k, TOY)
    counts = all_to_all_time(link, 8 * config.model.n_experts, TOY)
    seconds = expert_parallel_time(config, dims, TOY, 3, 250, 1000.0, replayed_collectives(config))
    assert seconds == pytest.approx(3 * (counts + 4 * exchange), rel=1e-12)


def test_op_level_checkpointing_gathers_the_allgather_dispatchs_tokens_and_weights_again():
    """selective_ops keeps the exchange's other outputs but runs its differentiable all-gathers again: per MoE layer,
    ep x the rank's tokens and their fp32 router weights."""
    from optimus.plan.block_collectives import allgather_exchange_bytes, expert_parallel_time
    from optimus.plan.comms import ring_time

    def seconds(mode: str) -> float:
        layout = validate_layout(load_config(CONFIGS / "mula-tiny-moe.yaml", [
            "--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.ep_dispatch=allgather",
            f"--train.activation_checkpointing={mode}"]), 4)
        again = replayed_collectives(layout.config)
        return expert_parallel_time(layout.config, layout.dims, TOY, 3, 250, 1000.0, again)

    layout = validate_layout(load_config(CONFIGS / "mula-tiny-moe.yaml", [
        "--parallel.dp_shard=4", "--parallel.ep=2"]), 4)
    link = group_link(layout.dims, ("ep",), TOY)
    sizes = allgather_exchange_bytes(2, 1000.0, 250, layout.config.model.top_k)
    gathers = ring_time(link, sizes["tokens"]) + ring_time(link, sizes["router_weights"])
    assert seconds("selective_ops") - seconds("none") == pytest.approx(3 * gathers, rel=1e-9)
