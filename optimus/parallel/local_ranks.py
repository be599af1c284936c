"""Run a measurement on R forked ranks of this machine, joined over a file rendezvous: CPU ranks by gloo, or one
rank per local accelerator by its own library (NCCL/RCCL, XCCL: launch.backend_for).

For the planner's calibration (optimus/plan/calibrate.py, calibrate_node.py): it times collectives and the share
of the cores R processes get, or a node's devices, without a launcher. The parent opens no device context (a
forked child could not use one its parent holds). Forked children run one thread each (a fork after
OpenMP started several can hang in its first multi-threaded op, see CPU-NOTES) and leave through
barrier + destroy + os._exit, so no rank aborts at interpreter exit. A child compiles (torch.compile) in its own
process: the compile workers of a parent that compiled before forking did not survive the fork. Results travel as
JSON: they are plain numbers and lists, and nothing a child wrote is ever unpickled.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist


class LocalRanksError(RuntimeError):
    """A rank failed or did not finish in time; the message says which and why."""


def compile_without_the_parents_workers() -> None:
    """In a forked child: torch.compile's pool of compile workers, where the parent had started one (by compiling
    before the fork), lives on in the child without the parent's thread that reads its results, so the child's
    first compile would wait forever. Inductor then compiles in this process instead (where the parent never
    loaded inductor, the child starts its own pool as any process does: nothing to do)."""
    inductor_config = sys.modules.get("torch._inductor.config")
    if inductor_config is not None:
        inductor_config.compile_threads = 1


def _child(rank: int, world: int, init_file: str, out_dir: str, fn: Callable, args: tuple, device_type: str) -> None:
    from optimus.parallel.launch import backend_for, device_for

    torch.set_num_threads(1)
    compile_without_the_parents_workers()
    outcome: dict[str, Any]
    try:
        device = device_for(rank, device_type)
        if device.type != "cpu":
            getattr(torch, device.type).set_device(device)
        dist.init_process_group(backend_for(device), init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        outcome = {"ok": fn(rank, world, *args)}
        dist.barrier()
    except BaseException:  # the parent reports it with the rank's traceback
        outcome = {"error": traceback.format_exc()}
    try:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        os._exit(0)


def run_on_local_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 180.0,
                       device_type: str = "cpu") -> list[Any]:
    """fn(rank, world, *args) on `world` forked ranks, each on launch.device_for(rank, device_type) (gloo on the
    CPU); each rank's JSON-serialisable result, in rank order."""
    with tempfile.TemporaryDirectory(prefix="optimus-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        pids = {}
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                _child(rank, world, init_file, tmp, fn, args, device_type)
            pids[rank] = pid
        pending = wait_or_kill(pids, timeout)
        results, failures = [], []
        for rank in range(world):
            path = Path(tmp) / f"rank{rank}.json"
            if not path.exists():
                why = f"did not finish within {timeout:g} s" if rank in pending else "died without a result"
                failures.append((True, f"rank {rank} of {world} {why}"))
                continue
            outcome = json.loads(path.read_text())
            if "error" in outcome:
                # a rank whose peer failed reports a broken collective or rendezvous: name the rank that failed
                failures.append((_failed_in_torch_distributed(outcome["error"]),
                                 f"rank {rank} of {world} failed:\n{outcome['error']}"))
            else:
                results.append(outcome["ok"])
        if failures:
            raise LocalRanksError(sorted(failures, key=lambda failure: failure[0])[0][1])
        return results


def wait_or_kill(pids: dict[int, int], timeout: float) -> set[int]:
    """Wait up to `timeout` seconds for the forked ranks {rank: pid} to exit; kill those still running and return
    their ranks."""
    deadline = time.monotonic() + timeout
    pending = dict(pids)
    while pending and time.monotonic() < deadline:
        for rank, pid in list(pending.items()):
            if os.waitpid(pid, os.WNOHANG)[0]:
                del pending[rank]
        time.sleep(0.02)
    for pid in pending.values():
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return set(pending)


def _failed_in_torch_distributed(traceback_text: str) -> bool:
    """Whether the innermost frame of a rank's traceback is torch.distributed's: the mark of a rank that met its
    peer's failure (a collective or the rendezvous's connection closed by the peer) rather than failed itself."""
    frames = [line for line in traceback_text.splitlines() if line.lstrip().startswith('File "')]
    return bool(frames) and f"{os.sep}torch{os.sep}distributed{os.sep}" in frames[-1]
