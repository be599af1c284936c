"""run_distributed: run a function on N forked CPU ranks joined by gloo, for tests.

Settings that held up on a 2-core machine (see ../shared/CPU-NOTES.md): fork after importing
torch.distributed, one thread per child, a file:// rendezvous, a deadline, and ending each child
with barrier + destroy_process_group + os._exit so no rank aborts at interpreter exit; a child compiles in its own
process (local_ranks.compile_without_the_parents_workers: a test before it may have compiled in this one).
"""

from __future__ import annotations

import functools
import os
import pickle
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # noqa: F401  (import in the parent, before forking)
import torch.distributed.fsdp  # noqa: F401
import torch.distributed.tensor  # noqa: F401

from optimus.parallel.local_ranks import compile_without_the_parents_workers, wait_or_kill


class DistributedTestError(AssertionError):
    """A rank failed or hung; the message carries that rank's traceback."""


def _child(rank: int, world_size: int, init_file: str, result_dir: str, fn: Callable, args, kwargs) -> None:
    torch.set_num_threads(1)
    compile_without_the_parents_workers()
    status, payload = "ok", None
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        payload = fn(rank, world_size, *args, **kwargs)
        dist.barrier()
    except BaseException:  # report everything, including assertion failures, to the parent
        status, payload = "error", traceback.format_exc()
    try:
        with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as handle:
            pickle.dump((status, payload), handle)
    except Exception:
        with open(os.path.join(result_dir, f"rank{rank}.pkl"), "wb") as handle:
            pickle.dump(("error", f"rank {rank}: result not picklable\n{traceback.format_exc()}"), handle)
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(0)


RANK_DEADLINE_S = 180.0  # how long forked ranks may run before they are killed as hung


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = RANK_DEADLINE_S,
                    **kwargs: Any) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on `world_size` forked ranks; return each rank's result.

    fn must be importable state-free code; its return value must be picklable (use .tolist() or
    tensors). Raises DistributedTestError with the first failing rank's traceback.
    """
    with tempfile.TemporaryDirectory(prefix="optimus-dist-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        pids = {}
        for rank in range(world_size):
            pid = os.fork()
            if pid == 0:
                _child(rank, world_size, init_file, tmp, fn, args, kwargs)
            pids[rank] = pid
        pending = wait_or_kill(pids, timeout)
        results, failures = [], []
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pkl"
            if not path.exists():
                reason = "hung (killed at the deadline)" if rank in pending else "died without a result"
                raise DistributedTestError(f"rank {rank} of {world_size} {reason}")
            status, payload = pickle.loads(path.read_bytes())
            if status != "ok":
                failures.append(f"rank {rank} of {world_size} failed:\n{payload}")
            results.append(payload)
        if failures:  # the rank that failed first, not one that lost its peer when that rank exited
            raise DistributedTestError(next((f for f in failures if "closed by peer" not in f), failures[0]))
        return results


def run_forked(fn: Callable, *args: Any, timeout: float = RANK_DEADLINE_S, **kwargs: Any) -> Any:
    """Run fn(*args, **kwargs) in a forked child and return its result (or raise its failure).

    For tests that must not leave state in the test process: a fake process group, DeviceMesh and
    DTensor caches built on it (a mesh compares equal regardless of its process groups, so caches
    filled through a fake group could be reused by a later real one of the same shape).
    """
    with tempfile.TemporaryDirectory(prefix="optimus-fork-") as tmp:
        result_path = os.path.join(tmp, "result.pkl")
        pid = os.fork()
        if pid == 0:
            compile_without_the_parents_workers()
            try:
                outcome = ("ok", fn(*args, **kwargs))
            except BaseException:
                outcome = ("error", traceback.format_exc())
            try:
                with open(result_path, "wb") as handle:
                    pickle.dump(outcome, handle)
            finally:
                os._exit(0)
        wait_or_kill({0: pid}, timeout)
        if not os.path.exists(result_path):
            raise DistributedTestError("forked test process hung or died without a result")
        status, payload = pickle.loads(Path(result_path).read_bytes())
        if status != "ok":
            raise DistributedTestError(f"forked test failed:\n{payload}")
        return payload


def in_forked_process(test_fn: Callable) -> Callable:
    """Decorator: run a test's body in a forked child (see run_forked); fixtures still work."""

    @functools.wraps(test_fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return run_forked(test_fn, *args, **kwargs)

    return wrapper
