"""zero1's flat buckets (optim/flat.py) where parameters have fewer rows than the group has ranks: 3 experts
(the router's [3, 64] and the expert weights' [3, ...]) over dp 4. The buckets carry no row padding, training
matches one process, and a checkpoint written over 4 ranks (each rank's flat ranges as several boxes of the
parameters' global shapes, saved asynchronously) resumes at zero1 over 2 ranks and at fsdp."""

from __future__ import annotations

import math

import pytest

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import (
    LOSS_RTOL_LATER_STEPS,
    CheckpointPlan,
    assert_parity,
    merge_rank_records,
    reference_run,
    run_parallel_rank,
    tiny_config,
)

pytestmark = pytest.mark.distributed

STEPS, SAVE_AT = 4, 2
ROUTER = "layers.0.mlp.router.weight"


def _config(world: int, mode: str = "zero1"):
    return tiny_config(moe=True, model={"n_experts": 3}, parallel=dict(dp_shard=world, shard_mode=mode))


def _moments(model, optimizer) -> dict:
    """Every AdamW moment, whole, by checkpoint key (collective), from the state dict DCP saves."""
    from optimus.train.state import OptimizerState

    state = OptimizerState(model, optimizer).state_dict()
    return {key: value.full_tensor() for key, value in sorted(state.items()) if key.endswith(("exp_avg", "exp_avg_sq"))}


def _train_and_save(rank: int, world: int, config, run_dir: str) -> dict:
    """SAVE_AT steps at zero1 over `world` ranks, then an asynchronous checkpoint; the layout and the moments."""
    import functools

    import torch

    from optimus.checkpoint.manager import CheckpointManager
    from optimus.optim.build import build_optimizer
    from optimus.optim.buffers import buffer_nbytes
    from optimus.optim.flat import local_tensor
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.state import ModelState, OptimizerState
    from tests.helpers import parity

    dims = ParallelDims.from_config(config.parallel, world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    micro = functools.partial(parity.rank_micro_batches, micro_batch_size=config.train.micro_batch_size,
                              dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"))
    record = parity.train_model(model, optimizer, config, SAVE_AT, micro, mesh["dp"], keep_grads=rank == 0)
    buckets = [{"ranks": b.group.mesh.size(), "segment": b.segment, "held": b.held,
                "numels": [local_tensor(s.param).numel() for s in b.slots],
                "rows": [local_tensor(s.param).shape[0] for s in b.slots]} for b in optimizer.buckets]
    layout = [(b["ranks"], b["segment"]) for b in buckets]
    manager = CheckpointManager(run_dir, keep_last_k=10)
    manager.save(SAVE_AT, {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)},
                 {"contents": ["model", "optimizer"]}, asynchronous=True)
    manager.finish_pending()
    moments = _moments(model, optimizer)  # (collective)
    return {"record": record, "buckets": buckets, "buffer_bytes": optimizer.buffer_bytes(),
            "predicted_buffer_bytes": sum(buffer_nbytes(layout, 4, accumulates=False)),
            "moments": moments if rank == 0 else None}


def _load_moments(rank: int, world: int, config, run_dir: str) -> dict | None:
    """The moments a zero1 run over `world` ranks holds right after loading step SAVE_AT (rank 0)."""
    import torch

    from optimus.checkpoint.manager import CheckpointManager
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.train.state import ModelState, OptimizerState

    dims = ParallelDims.from_config(config.parallel, world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    CheckpointManager(run_dir, keep_last_k=10).load(
        SAVE_AT, {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)})
    moments = _moments(model, optimizer)
    return moments if rank == 0 else None


def test_fewer_rows_than_ranks_cost_no_padding_train_as_one_process_and_reshard(tmp_path):
    import torch

    from optimus.checkpoint.safe_reader import read_index

    config = _config(4)
    reference = reference_run(config, STEPS)
    saved = run_distributed(_train_and_save, 4, config, str(tmp_path))

    # no row padding: each bucket is its parameters end to end, cut into ceil(elements / 4) per rank
    buckets = saved[0]["buckets"]
    assert any(rows < 4 for b in buckets for rows in b["rows"])  # the router and the experts: 3 rows
    for b in buckets:
        assert b["segment"] == math.ceil(sum(b["numels"]) / b["ranks"]), b
        row_blocks = sum(math.ceil(r / b["ranks"]) * (n // r) for r, n in zip(b["rows"], b["numels"]))
        assert b["segment"] < row_blocks  # what one rank's row blocks took (3 rows over 4: 1 row each, padded)
    for rank in saved:
        assert rank["buffer_bytes"] == rank["predicted_buffer_bytes"] > 0
    assert sum(rank["buckets"][0]["held"] for rank in saved) == sum(buckets[0]["numels"])

    # training as one process (losses, gradient norms and step-1 gradients within the parity tolerances)
    assert_parity(reference_run(config, SAVE_AT), merge_rank_records([r["record"] for r in saved]))

    # the checkpoint: the parameters' global shapes, each covered once by the ranks' boxes, and a range that
    # begins or ends inside a row saved as partial-row boxes beside whole rows
    index = read_index(tmp_path / "checkpoints" / f"step-{SAVE_AT}").state_dict_metadata
    assert tuple(index[f"optimizer.state.{ROUTER}.exp_avg"].size) == (3, 64)
    moments = {key: md for key, md in index.items() if key.startswith("optimizer.state.") and key.endswith("exp_avg")}
    assert len(moments) > 10
    for key, md in moments.items():
        assert sum(math.prod(c.sizes) for c in md.chunks) == math.prod(md.size), key
    cut = [key for key, md in moments.items() if len(md.size) > 1 and len(md.chunks) > 1
           and any(c.sizes[-1] < md.size[-1] for c in md.chunks)]
    assert cut, "no parameter's state is split inside a row"

    # resumed at zero1 over 2 ranks: the moments come back bit for bit, and the losses go on
    moments = run_distributed(_load_moments, 2, _config(2), str(tmp_path))[0]
    want = saved[0]["moments"]
    assert sorted(moments) == sorted(want) and len(want) > 10
    for key in want:
        assert torch.equal(moments[key], want[key]), key
    for after in (_config(2), _config(2, "fsdp")):
        resumed = run_distributed(run_parallel_rank, 2, after, STEPS, CheckpointPlan(str(tmp_path), load_step=SAVE_AT))
        curve = saved[0]["record"].losses + resumed[0].losses
        assert len(curve) == STEPS
        for step, (want_loss, got) in enumerate(zip(reference.losses, curve), start=1):
            assert abs(got - want_loss) <= LOSS_RTOL_LATER_STEPS * abs(want_loss), (after.parallel, step, curve)
