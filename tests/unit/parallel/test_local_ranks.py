"""run_on_local_ranks: the shipped runner the planner's calibration measures with."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optimus.parallel.local_ranks import LocalRanksError, run_on_local_ranks


def _sum_of_ranks(rank: int, world: int, scale: float) -> list[float]:
    value = torch.tensor([float(rank) * scale])
    dist.all_reduce(value)
    return [rank, float(value)]


def _fails_on_rank_one(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    return rank


@pytest.mark.distributed
def test_each_rank_result_comes_back_in_rank_order():
    assert run_on_local_ranks(_sum_of_ranks, 2, 2.0) == [[0, 2.0], [1, 2.0]]


@pytest.mark.distributed
def test_a_failing_rank_is_named_with_its_traceback():
    with pytest.raises(LocalRanksError, match=r"rank 1 of 2 failed:(.|\n)*planted failure"):
        run_on_local_ranks(_fails_on_rank_one, 2, timeout=60.0)


def test_a_rank_that_met_its_peers_failure_in_torch_distributed_is_not_named_first():
    from optimus.parallel.local_ranks import _failed_in_torch_distributed

    torch_frame = '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 2169, in _new'
    # the peer closed the rendezvous under this rank (once seen under make test's load, and named first by the old
    # check, which read the third line from the end: a caret line's neighbour in Python 3.11's tracebacks)
    met_it = ("Traceback (most recent call last):\n"
              '  File "/repo/optimus/parallel/local_ranks.py", line 34, in _child\n    dist.init_process_group(\n'
              f"{torch_frame}\n    backend_class = ProcessGroupGloo(\n                    ^^^^^^^^^^^^^^^^^\n"
              "RuntimeError: Gloo connectFullMesh failed with ... Connection closed by peer")
    failed = ("Traceback (most recent call last):\n"
              '  File "/repo/optimus/parallel/local_ranks.py", line 35, in _child\n    outcome = fn()\n'
              '  File "/repo/tests/unit/parallel/test_local_ranks.py", line 20, in _fails_on_rank_one\n'
              '    raise ValueError("planted failure")\nValueError: planted failure')
    assert _failed_in_torch_distributed(met_it) and not _failed_in_torch_distributed(failed)


def _compiled_sum(rank: int, world: int) -> float:
    doubled = torch.compile(lambda x: torch.cos(x) * 2 + x)
    return float(doubled(torch.ones(8)).sum())


def _compile_then_run_ranks_that_compile(cache_dir: str) -> list[float]:
    import os

    import torch._inductor.config as inductor_config

    # nothing from a cache: the kernels are built, on the pool of compile workers
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    inductor_config.fx_graph_cache = False
    inductor_config.compile_threads = 2  # a pool of compile workers, as on any machine of 2 cores or more
    torch.compile(lambda x: torch.sin(x) * 3 - x)(torch.ones(4))
    return run_on_local_ranks(_compiled_sum, 1, timeout=120)


@pytest.mark.slow  # inductor's C++ builds, uncached: ~30 s on 2 cores
def test_a_rank_compiles_after_its_parent_compiled(tmp_path):
    """The parent's compile workers do not survive the fork: a rank compiling on them waited forever."""
    from tests.helpers import run_forked

    expected = float((torch.cos(torch.ones(8)) * 2 + 1).sum())
    # forked: this test process keeps no pool and no inductor settings
    [got] = run_forked(_compile_then_run_ranks_that_compile, str(tmp_path / "inductor"), timeout=240)
    assert got == pytest.approx(expected)


_DEVICES_ASKED: list[tuple[int, str]] = []


def _devices_asked(rank: int, world: int) -> list:
    return [list(asked) for asked in _DEVICES_ASKED]


@pytest.mark.distributed
def test_each_rank_runs_on_its_own_device(monkeypatch):
    """On a GPU node rank r must take device r (a CPU test cannot see the device itself, so the question each
    forked rank asks is recorded: launch.device_for(its rank, the device type))."""
    from optimus.parallel import launch

    real = launch.device_for
    monkeypatch.setattr(launch, "device_for",
                        lambda rank, device_type: _DEVICES_ASKED.append((rank, device_type)) or real(rank, "cpu"))
    assert run_on_local_ranks(_devices_asked, 2) == [[[0, "cpu"]], [[1, "cpu"]]]


def test_a_rank_still_running_at_the_timeout_is_killed_and_named_as_timed_out(monkeypatch):
    """A rank that hangs is reported as "did not finish within N s", not as one that "died without a result"
    (each "rank" here is a stand-in process that sleeps, spawned where the runner forks: no torch in it)."""
    import os

    from optimus.parallel import local_ranks

    spawned = []
    monkeypatch.setattr(local_ranks.os, "fork",
                        lambda: spawned.append(os.posix_spawnp("sleep", ["sleep", "60"], os.environ)) or spawned[-1])
    with pytest.raises(LocalRanksError) as err:
        run_on_local_ranks(_sum_of_ranks, 1, 1.0, timeout=0.6)
    assert str(err.value) == "rank 0 of 1 did not finish within 0.6 s"  # (a sub-second timeout read "within 0 s")
    with pytest.raises(ChildProcessError):  # killed and reaped: nothing left running
        os.waitpid(spawned[0], os.WNOHANG)


def _leave_without_a_result(rank, world):
    import os

    os._exit(3)


def test_a_rank_that_exits_without_a_result_is_said_to_have_died():
    with pytest.raises(LocalRanksError, match="^rank 0 of 1 died without a result$"):
        run_on_local_ranks(_leave_without_a_result, 1, timeout=60.0)


def test_a_child_compiles_in_its_own_process_where_inductor_is_loaded(monkeypatch):
    import sys
    from types import SimpleNamespace

    from optimus.parallel.local_ranks import compile_without_the_parents_workers

    inductor_config = SimpleNamespace(compile_threads=4)  # stands for the loaded torch._inductor.config
    monkeypatch.setitem(sys.modules, "torch._inductor.config", inductor_config)
    compile_without_the_parents_workers()
    assert inductor_config.compile_threads == 1
