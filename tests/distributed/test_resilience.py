"""Resilience across ranks (gloo, 2 ranks): a spike seen by one rank only (its data under data
parallelism, the last stage's loss under pipeline parallelism) makes every rank skip the same step, since
the guard judges the global loss; the straggler report names the rank that is slow."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

SPIKE_STEP = 10


def _train_with_a_spike_on_rank_1(rank: int, world: int, layout: str):
    import torch

    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from optimus.resilience.guards import LossSpikeGuard
    from tests.helpers.parity import rank_micro_batches, tiny_config
    from optimus.train.step import train_step

    config = tiny_config(parallel={layout: world})
    dims = ParallelDims(world_size=world, **{layout: world})
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, torch.device("cpu"))
    optimizer = build_optimizer(model, config.optim)
    guard = LossSpikeGuard(zscore=4.0, window=8)
    # rank 1 holds half the batch (dp) or the last stage, which alone computes the loss (pp)
    module = model.pipeline.stages[0] if layout == "pp" else model
    forward = module.forward

    def spiky_forward(*args, **kwargs):
        out = forward(*args, **kwargs)
        if layout == "pp":
            return out * 1000  # the last stage's output is its micro-batch's loss
        out.loss = out.loss * 1000
        return out

    def local(param):
        return param.detach().to_local() if hasattr(param, "to_local") else param.detach()

    t = config.train
    skipped, unchanged = [], None
    for step in range(1, SPIKE_STEP + 1):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, config.model.vocab_size, (t.global_batch_size, t.seq_len + 1), generator=g)
        dp_rank, dp_size = mesh.local_rank("dp"), mesh.size("dp")
        batch = rank_micro_batches((tokens[:, :-1], tokens[:, 1:]), t.micro_batch_size, dp_rank, dp_size)
        if step == SPIKE_STEP and rank == 1:
            module.forward = spiky_forward
        before = [local(p).clone() for p in model.parameters()]
        result = train_step(model, optimizer, batch, device=torch.device("cpu"), grad_clip=1.0,
                            dp_mesh=mesh["dp"], skip_step=guard)
        skipped.append(result.skip_reason)
        if step == SPIKE_STEP:
            unchanged = all(torch.equal(a, local(p)) for a, p in zip(before, model.parameters()))
    return skipped, unchanged, list(guard.losses)


@pytest.mark.parametrize("layout", ["dp_shard", "pp"])
def test_a_spike_seen_by_one_rank_makes_every_rank_skip_the_same_step(layout):
    results = run_distributed(_train_with_a_spike_on_rank_1, 2, layout)
    expected = [None] * (SPIKE_STEP - 1) + ["loss spike"]
    for skipped, unchanged, history in results:
        assert skipped == expected
        assert unchanged  # this rank's weights (shard or stage) stayed as they were
    assert results[0][2] == results[1][2]  # both guards saw the same global losses


def _time_steps_with_rank_1_asleep(rank: int, world: int):
    import time

    import torch

    from optimus.resilience.stragglers import StragglerMonitor

    monitor = StragglerMonitor(every=3, factor=3.0, device=torch.device("cpu"))
    reports = []
    for step in range(1, 4):
        with monitor.timed_step():
            time.sleep(0.25 if rank == 1 else 0.0)
        found = monitor.check(step)
        reports.append(None if found is None else [(s.rank, s.host) for s in found])
    return reports


def test_the_straggler_report_names_the_rank_that_sleeps():
    import socket

    results = run_distributed(_time_steps_with_rank_1_asleep, 2)
    host = socket.gethostname()
    for reports in results:  # every rank gets the same report (rank 0's console prints it)
        assert reports == [None, None, [(1, host)]]  # compared every 3 steps only
