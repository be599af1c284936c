"""parallelize_model in one process: activation checkpointing (full, selective masks, selective_ops) changes memory, not
results or checkpoint keys; the gradient norm and clipping handle plain tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from optimus.models.transformer import build_model
from optimus.parallel.mesh import ParallelDims
from optimus.parallel.parallelize import parallelize_model, single_process_name
from tests.helpers.parity import global_batches, rank_micro_batches, tiny_config
from optimus.train.step import clip_gradients, forward_backward
from tests.helpers import in_forked_process


def _grads(config) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    model = build_model(config.model, seed=0)
    model = parallelize_model(model, ParallelDims(world_size=1), None, config)
    batch = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size)
    forward_backward(model, batch, torch.device("cpu"), "fp32")
    names = {single_process_name(name): p.grad for name, p in model.named_parameters()}
    return names, model


@pytest.fixture(scope="module")
def plain_grads():
    """_grads of the plain tiny model (no recompute), per moe: computed once, the reference of every case below."""
    done: dict[bool, tuple[dict[str, torch.Tensor], torch.nn.Module]] = {}

    def get(moe: bool):
        if moe not in done:
            done[moe] = _grads(tiny_config(moe=moe))
        return done[moe]

    return get


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.parametrize("mode", ["full", "selective_ops"])
def test_activation_checkpointing_keeps_gradients_and_checkpoint_keys(moe, mode, plain_grads):
    want, plain = plain_grads(moe)
    got, wrapped = _grads(tiny_config(moe=moe, train=dict(activation_checkpointing=mode)))
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    # DCP sees the single-process names: a checkpoint moves between runs with and without it
    assert set(get_model_state_dict(wrapped)) == set(get_model_state_dict(plain))


def test_selective_ops_recomputes_no_matmul_nor_the_experts_grouped_gemms():
    """Op-level checkpointing replays the cheap ops in backward and takes the matmuls' and the fused expert op's
    outputs from its cache: recomputing the experts would cost a third of their compute again."""
    from tests.helpers.dispatch import OpCounter

    def backward_ops(mode: str) -> dict[str, int]:
        config = tiny_config(moe=True, train=dict(activation_checkpointing=mode))
        model = parallelize_model(build_model(config.model, seed=0), ParallelDims(world_size=1), None, config)
        batch = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size)[0]
        loss = model(batch[0], labels=batch[1]).loss
        with OpCounter() as backward:  # the recompute runs inside backward; ops taken from the cache never dispatch
            loss.backward()
        return backward.calls

    plain, ops_level = backward_ops("none"), backward_ops("selective_ops")
    assert ops_level["optimus.moe_experts_backward.default"] == plain["optimus.moe_experts_backward.default"] > 0
    for kept in ("aten.mm.default", "optimus.moe_experts.default"):  # the backward's own matmuls only
        assert ops_level.get(kept, 0) == plain.get(kept, 0), kept
    assert ops_level["aten.rsqrt.default"] > plain.get("aten.rsqrt.default", 0)  # the norms are recomputed


def test_selective_ops_keeps_integer_all_gathers_and_replays_those_of_activations():
    """The op-level policy's one exception (parallelize._ops_policy): an all-gather of activations is replayed (its
    output is ep (tp) x this rank's rows), an integer one (the routing's expert ids and token counts: few numbers,
    and a host read each exchange) is kept; the EP exchanges and reduce-scatters are kept whatever they carry."""
    from torch.utils.checkpoint import CheckpointPolicy

    import optimus.parallel.collective_ops  # noqa: F401 (registers the optimus:: collectives)
    from optimus.parallel.parallelize import _ops_policy

    ops, ints, floats = torch.ops.optimus, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    assert _ops_policy(None, ops.all_gather_rows.default, ints, "group") == CheckpointPolicy.MUST_SAVE
    assert _ops_policy(None, ops.all_gather_rows.default, floats, "group") == CheckpointPolicy.PREFER_RECOMPUTE
    for op in (ops.all_to_all_rows.default, ops.reduce_scatter_rows.default):
        assert _ops_policy(None, op, floats, "group") == CheckpointPolicy.MUST_SAVE


MASKS = [["moe"], ["attention", "norms"], ["attention", "moe", "norms"], ["mlp", "norms"]]


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
@pytest.mark.parametrize("recompute", MASKS, ids="+".join)
def test_selective_mask_keeps_gradients_and_names(moe, recompute, plain_grads):
    if recompute == ["moe"] and not moe:
        recompute = ["mlp"]  # ["moe"] alone names nothing in a dense model (a config error)
    want, plain = plain_grads(moe)
    config = tiny_config(moe=moe, train=dict(activation_checkpointing="selective", recompute=recompute))
    got, masked = _grads(config)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-8, msg=name)
    # a class swap, not a wrapper: parameter names, state-dict and DCP keys are the plain model's
    assert [n for n, _ in masked.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert list(masked.state_dict()) == list(plain.state_dict())
    assert set(get_model_state_dict(masked)) == set(get_model_state_dict(plain))


def test_selective_mask_recomputes_exactly_the_named_modules():
    from optimus.models.moe import MoE

    config = tiny_config(moe=True, train=dict(activation_checkpointing="selective", recompute=["moe", "norms"]))
    model = parallelize_model(build_model(config.model, seed=0), ParallelDims(world_size=1), None, config)
    block = model.layers["0"]
    recomputed = {name for name, m in block.named_modules() if getattr(m, "_recomputed", False)}
    assert recomputed == {"mlp", "attn_norm", "mlp_norm", "attn.q_norm", "attn.k_norm"}
    assert isinstance(block.mlp, MoE)  # Block still tells MoE from a dense MLP


@pytest.mark.parametrize("mode, runs", [("none", 1), ("full", 2), ("selective_ops", 2)])
def test_full_and_op_level_checkpointing_run_each_block_again_in_backward(mode, runs):
    """Counted where it happens: a block's modules are called again by the backward (saved-tensor hooks cannot
    tell, as checkpoint keeps its own saved tensors out of them)."""
    config = tiny_config(moe=True, train=dict(activation_checkpointing=mode))
    model = parallelize_model(build_model(config.model, seed=0), ParallelDims(world_size=1), None, config)
    calls = []
    for block in model.layers.values():
        block.get_submodule(_q_proj_of(block)).register_forward_hook(lambda *_: calls.append(1))
    batch = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size)[0]
    loss = model(batch[0], labels=batch[1]).loss
    assert len(calls) == len(model.layers)
    loss.backward()
    assert len(calls) == runs * len(model.layers)


def _q_proj_of(block: torch.nn.Module) -> str:
    return next(name for name, _ in block.named_modules() if name.endswith("attn.q_proj"))


def test_selective_mask_keeps_fewer_activations():
    """Recomputed modules keep only their inputs: fewer bytes saved for backward than no checkpointing."""
    from optimus.models.transformer import build_model as build

    def saved(config) -> int:
        model = parallelize_model(build(config.model, seed=0), ParallelDims(world_size=1), None, config)
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        ids = global_batches(config, 1)[0][0][:2]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids, ids)
        return total

    none = saved(tiny_config(moe=True))
    moe_only = saved(tiny_config(moe=True, train=dict(activation_checkpointing="selective", recompute=["moe"])))
    everything = saved(tiny_config(moe=True, train=dict(activation_checkpointing="selective",
                                                        recompute=["attention", "moe", "norms"])))
    assert everything < moe_only < none


@pytest.mark.slow
def test_compile_per_block_keeps_gradients_and_names():
    """train.compile: each block is compiled in place (the fused MoE experts op breaks the graph
    around itself), giving the eager gradients under the same parameter names."""
    want, _ = _grads(tiny_config(moe=True))
    got, compiled = _grads(tiny_config(moe=True, train=dict(compile=True)))
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-6, msg=name)
    assert all(hasattr(block, "_compiled_call_impl") for block in compiled.layers.values())


def test_selective_needs_a_non_empty_mask():
    from optimus.config import ConfigError, build_config

    with pytest.raises(ConfigError, match="train.recompute"):
        build_config({"train": {"activation_checkpointing": "selective", "recompute": []}})


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_selective_mask_must_name_a_module_the_model_has(moe):
    from optimus.config import ConfigError, build_config

    wrong, default = (["mlp"], ["moe"]) if moe else (["moe"], ["mlp"])
    model = {"preset": "mula-tiny-moe" if moe else "mula-tiny-dense"}
    with pytest.raises(ConfigError, match=rf"train.recompute \['{wrong[0]}'\] names nothing"):
        build_config({"model": model, "train": {"activation_checkpointing": "selective", "recompute": wrong}})
    # left unset, the mask recomputes the feed-forward the model has
    assert build_config({"model": model, "train": {"activation_checkpointing": "selective"}}).train.recompute == default


def test_clip_gradients_plain_tensors_matches_torch():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2, 2))]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    norm = clip_gradients(params, max_norm=1.0)
    assert norm == pytest.approx((7 * 4.0) ** 0.5)
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in params))
    assert total.item() == pytest.approx(1.0, rel=1e-5)


def _meta_model(config, dims):
    """Rank 0's model of a `dims.world_size`-rank job on the meta device, through a fake process group.

    Use world sizes no distributed test uses (8 here): building a fake-group mesh of the same shape in
    the parent process made a later forked 2-rank parity test differ from one process.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore
    import torch.distributed as dist

    from optimus.parallel.parallelize import build_parallel_model

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dims.world_size)
    try:
        return build_parallel_model(config, dims, dims.build_mesh("cpu"), "meta")
    finally:
        dist.destroy_process_group()


@in_forked_process  # builds a fake process group: keep it out of this process
def test_ops_checkpointing_with_one_rank_expert_groups():
    """ep = dp_shard: the experts have no FSDP replica; under ops they are left out of FSDP (a one-rank
    FSDP group unshards differently in the recompute, which op replay refuses). With HSDP they would
    need a group of their own: refused in one line."""
    from optimus.config import ConfigError
    from optimus.parallel.mesh import LayoutError

    config = tiny_config(moe=True, parallel=dict(dp_shard=8, ep=8),
                         train=dict(activation_checkpointing="selective_ops", global_batch_size=16))
    model = _meta_model(config, ParallelDims(dp_shard=8, ep=8, world_size=8))
    experts = model.layers["0"]._checkpoint_wrapped_module.mlp.experts
    assert experts.w_gate_up.device_mesh.mesh_dim_names == ("ep",)  # EP's DTensor, not FSDP's
    assert model.layers["0"].attn.q_proj.weight.device_mesh.mesh_dim_names == ("dp_shard",)

    hsdp = dict(dp_replicate=2, dp_shard=4, ep=4)
    with pytest.raises(ConfigError, match="activation_checkpointing=selective_ops") as err:  # refused when the config loads
        tiny_config(moe=True, parallel=hsdp, train=dict(activation_checkpointing="selective_ops", global_batch_size=16))
    assert "\n" not in str(err.value)
    # and by parallelize itself, for a caller that skips the config (the same one line)
    allowed = tiny_config(moe=True, parallel=hsdp, train=dict(global_batch_size=16))
    config = allowed.model_copy(update={"train": allowed.train.model_copy(update={"activation_checkpointing": "selective_ops"})})
    with pytest.raises(LayoutError, match="activation_checkpointing=selective_ops"):
        _meta_model(config, ParallelDims(**hsdp, world_size=8))
