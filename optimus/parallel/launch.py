"""Who am I in the job: rank, world size, local rank and rendezvous address from any launcher.

Reads torchrun, Slurm (`srun`), PBS/PALS (`mpiexec` on Aurora), MPICH/Intel MPI (`PMI_*`) and Open
MPI (`OMPI_COMM_WORLD_*`) environments, picks the device and the collective backend for it, and
initialises torch.distributed. The only module besides the cli package that reads environment variables.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

DEFAULT_PORT = 29500


class LaunchError(RuntimeError):
    """An environment that does not describe a usable job (one-line message with the fix)."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "single", "torchrun", "slurm", "pals", "pmi", "openmpi"
    # torchrun --max-restarts: which attempt this is, and whether its agent hosts the rendezvous store
    restart_count: int = 0
    agent_store: bool = False


def first_host(nodelist: str) -> str:
    """The first host of a Slurm nodelist: 'nid[001-004,010],gpu7' -> 'nid001'."""
    match = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        raise LaunchError(f"cannot read Slurm nodelist '{nodelist}': set MASTER_ADDR explicitly")
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _ints(env: Mapping[str, str], *names: str) -> list[int]:
    return [_int(env, name) for name in names]


def _int(env: Mapping[str, str], name: str, default: int | str | None = None) -> int:
    """A launcher variable as an integer (`default` when unset or empty), or LaunchError naming it."""
    value = env.get(name) or default
    if value is None:
        raise LaunchError(f"launcher variable {name} is not set: check the job script")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"launcher variable {name}={value!r} is not an integer: check the job script") from None


def _master(env: Mapping[str, str], fallback_host: str) -> tuple[str, int]:
    addr = env.get("MASTER_ADDR") or fallback_host
    return addr, _int(env, "MASTER_PORT", DEFAULT_PORT)


# a rank variable of each launcher, and the world size that must come with it
_RANK_AND_SIZE = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                  ("PMI_RANK", "PMI_SIZE"))


def detect_launch_env(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Rank, world and rendezvous from whichever launcher started this process (one process if none); LaunchError
    for variables that contradict each other (a rank past the world, a rank without a world size)."""
    env = os.environ if env is None else env
    launch = _from_launcher(env)
    if launch.world_size < 1 or not 0 <= launch.rank < launch.world_size:
        raise LaunchError(f"the launcher gave rank {launch.rank} of a world of {launch.world_size} ({launch.launcher}): "
                          "check the job script's task counts")
    if launch.local_world_size < 1 or not 0 <= launch.local_rank < launch.local_world_size:
        raise LaunchError(f"the launcher gave local rank {launch.local_rank} of {launch.local_world_size} on this node "
                          f"({launch.launcher}): check the job script's tasks per node")
    if not 0 < launch.master_port < 65536:
        raise LaunchError(f"MASTER_PORT {launch.master_port} is not a port (1-65535): set a free one")
    if launch.launcher == "single":
        # an sbatch script's own shell has SLURM_PROCID=0 without srun's task count: one process is right there;
        # any other rank without its world size is one task of a job this process cannot join
        for rank_name, size_name in _RANK_AND_SIZE:
            if rank_name in env and env[rank_name] != "0" and size_name not in env:
                raise LaunchError(f"{rank_name}={env[rank_name]} is set but {size_name} is not: launch through the "
                                  f"launcher that sets both (torchrun, srun, mpiexec), or unset {rank_name}")
    return launch


def _from_launcher(env: Mapping[str, str]) -> LaunchEnv:
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun, or any launcher that exports the standard names
        rank, world = _ints(env, "RANK", "WORLD_SIZE")
        local = _int(env, "LOCAL_RANK", rank)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        addr, port = _master(env, "127.0.0.1")
        restart = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return LaunchEnv(rank, world, local, local_world, addr, port, "torchrun", restart, agent_store)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _ints(env, "SLURM_PROCID", "SLURM_NTASKS")
        local = _int(env, "SLURM_LOCALID", 0)
        per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", str(world)))
        leading = re.match(r"\d+", per_node)  # "4(x2)" and the like: tasks on this node first
        if leading is None:
            raise LaunchError(f"cannot read Slurm's tasks per node {per_node!r}: check the job script's --ntasks-per-node")
        local_world = int(leading.group())
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        addr, port = _master(env, first_host(nodelist))
        return LaunchEnv(rank, world, local, local_world, addr, port, "slurm")
    if "PALS_RANKID" in env:  # Cray PALS (Aurora's mpiexec); the world size comes from PMI
        rank = _ints(env, "PALS_RANKID")[0]
        world = _int(env, "PMI_SIZE", env.get("PALS_SIZE", 0) or 0)
        if world <= 0:
            raise LaunchError("PALS_RANKID is set but PMI_SIZE is not: launch with mpiexec -n N so PMI_SIZE is exported")
        local = _int(env, "PALS_LOCAL_RANKID", 0)
        local_world = _int(env, "PALS_LOCAL_SIZE", env.get("PMI_LOCAL_SIZE", 1))
        addr, port = _master(env, _pbs_first_host(env))
        return LaunchEnv(rank, world, local, local_world, addr, port, "pals")
    if "OMPI_COMM_WORLD_RANK" in env and "OMPI_COMM_WORLD_SIZE" in env:
        rank, world = _ints(env, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
        local = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
        local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1)
        addr, port = _master(env, _pbs_first_host(env))
        return LaunchEnv(rank, world, local, local_world, addr, port, "openmpi")
    if "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH, Intel MPI
        rank, world = _ints(env, "PMI_RANK", "PMI_SIZE")
        local = _int(env, "MPI_LOCALRANKID", env.get("PMI_LOCAL_RANK", 0))
        local_world = _int(env, "MPI_LOCALNRANKS", env.get("PMI_LOCAL_SIZE", 1))
        addr, port = _master(env, _pbs_first_host(env))
        return LaunchEnv(rank, world, local, local_world, addr, port, "pmi")
    return LaunchEnv(0, 1, 0, 1, env.get("MASTER_ADDR", "127.0.0.1"), _int(env, "MASTER_PORT", DEFAULT_PORT), "single")


def _pbs_first_host(env: Mapping[str, str]) -> str:
    nodefile = env.get("PBS_NODEFILE")
    if nodefile and os.path.isfile(nodefile):
        with open(nodefile) as handle:
            for line in handle:
                if line.strip():
                    return line.strip()
    return "127.0.0.1"


def device_for(local_rank: int, device_type: str | None = None) -> torch.device:
    """This process's device: its GPU (CUDA/ROCm), its XPU tile, or the CPU."""
    if device_type is None:
        if torch.cuda.is_available():
            device_type = "cuda"
        elif hasattr(torch, "xpu") and torch.xpu.is_available():
            device_type = "xpu"
        else:
            device_type = "cpu"
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, local_rank)


def backend_for(device: torch.device) -> str:
    """The default process group's backend per device: the device's own library beside gloo for the host.

    Decided here only. Every group (DeviceMesh dims included) inherits it. Per-step numbers (losses,
    gradient norms, expert counts) are reduced as tensors on the device, by the device's library: no
    host round trip. The `cpu:gloo` half carries what must stay on the host (Python objects in
    `all_gather_object`, a host tensor a helper may reduce): NCCL/XCCL alone would refuse a CPU tensor.
    CUDA uses NCCL (RCCL behind the same name on ROCm), XPU uses XCCL, the CPU gloo alone.
    """
    library = {"cuda": "nccl", "xpu": "xccl"}.get(device.type)
    return f"cpu:gloo,{device.type}:{library}" if library else "gloo"


def rendezvous_store(launch: LaunchEnv, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """The job's TCP store at MASTER_ADDR:MASTER_PORT (hosted here when `is_master`), or LaunchError in one line:
    a port another process holds, or a store no one opened in time, is the user's setting to fix, not a fault."""
    where = f"{launch.master_addr}:{launch.master_port}"
    try:
        return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size, is_master=is_master,
                             timeout=timedelta(seconds=timeout_s))
    except dist.DistNetworkError as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        if is_master and "EADDRINUSE" in reason:
            raise LaunchError(f"MASTER_PORT {launch.master_port} is in use on this host (another job, or a process "
                              "left over from one, holds it): set MASTER_PORT to a free port, the same on every "
                              "rank") from None
        if is_master:
            raise LaunchError(f"rank 0 could not open the job's rendezvous on port {launch.master_port} ({reason}): "
                              "set MASTER_PORT to a free port this host may listen on") from None
        if "timed out" in reason:
            raise LaunchError(f"rank {launch.rank} found no rendezvous at {where} within {timeout_s:g} s: check that "
                              "rank 0 started, that MASTER_ADDR names its host and that MASTER_PORT is open between "
                              "the nodes") from None
        raise LaunchError(f"rank {launch.rank} could not reach the rendezvous at {where} ({reason}): check "
                          "MASTER_ADDR and MASTER_PORT") from None


def init_distributed(launch: LaunchEnv, device: torch.device, timeout_s: float = 600.0) -> None:
    """Join the process group described by `launch` (nothing to do for a single process)."""
    if launch.world_size == 1 or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "xpu":
        torch.xpu.set_device(device)
    if launch.launcher == "torchrun" and launch.agent_store:
        # torchrun's agent hosts the rendezvous store and keeps it across restarts (--max-restarts): under
        # env:// a restarted attempt can read the dead attempt's gloo addresses and fail to connect. Each
        # attempt joins under its own key prefix, so it only ever sees its own peers.
        agent = rendezvous_store(launch, is_master=False, timeout_s=timeout_s)
        store = dist.PrefixStore(f"optimus/attempt-{launch.restart_count}", agent)
        dist.init_process_group(backend=backend_for(device), rank=launch.rank, world_size=launch.world_size,
                                store=store, timeout=timedelta(seconds=timeout_s))
        return
    if launch.launcher == "torchrun":
        dist.init_process_group(backend=backend_for(device), init_method="env://", timeout=timedelta(seconds=timeout_s))
        return
    store = rendezvous_store(launch, is_master=launch.rank == 0, timeout_s=timeout_s)
    dist.init_process_group(
        backend=backend_for(device), rank=launch.rank, world_size=launch.world_size, store=store,
        timeout=timedelta(seconds=timeout_s),
    )


# Variables that change which CPU kernels run without changing the machine (oneDNN's ISA cap, ATen's
# dispatch level): a measured CPU speed is only valid under the same values.
_CPU_KERNEL_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")


def cpu_speed_cache(env: Mapping[str, str] | None = None) -> tuple[Path, str]:
    """(file caching this machine's measured CPU speed, the kernel settings its entry is keyed by)."""
    env = os.environ if env is None else env
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    kernel_env = ",".join(f"{name}={env[name]}" for name in _CPU_KERNEL_VARIABLES if env.get(name))
    return base / "optimus" / "cpu_speed.json", kernel_env


def leave_distributed(exit_code: int) -> int:
    """End this process's part in a distributed job cleanly and exit with `exit_code`.

    Workers that simply return from main sometimes abort in the process group's destructors at exit
    ("terminate called without an active exception", ~10% of 4-rank gloo runs), which torchrun counts as
    a failure and answers with a restart of a finished job. A barrier (when all went well), an explicit
    destroy, flushed output and os._exit avoid that. Returns `exit_code` when no process group exists.
    """
    if not dist.is_initialized():
        return exit_code
    if exit_code == 0:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone: leaving is all that is left to do
            pass
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)
