"""Launcher detection from pure environment dicts: torchrun, Slurm, PBS/PALS, PMI, Open MPI, single; a
rendezvous that cannot be opened or reached is one line."""

from __future__ import annotations

import socket

import pytest
import torch

from optimus.parallel.launch import (
    DEFAULT_PORT,
    LaunchError,
    backend_for,
    detect_launch_env,
    device_for,
    first_host,
    init_distributed,
)


def test_no_launcher_is_one_process():
    launch = detect_launch_env({})
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (0, 1, 0, 1)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("127.0.0.1", DEFAULT_PORT, "single")


def test_torchrun_variables():
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "MASTER_ADDR": "node0", "MASTER_PORT": "1234"}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (5, 16, 1, 4)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("node0", 1234, "torchrun")


def test_standard_names_win_over_scheduler_variables():
    # torchrun inside an allocation: the scheduler's own variables describe the allocation, not the workers
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "7", "SLURM_NTASKS": "64"}
    assert detect_launch_env(env).launcher == "torchrun"


def test_slurm_variables_and_master_from_nodelist():
    env = {"SLURM_PROCID": "9", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "8",
           "SLURM_JOB_NODELIST": "frontier[00012-00013]"}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (9, 16, 1, 8)
    assert (launch.master_addr, launch.master_port, launch.launcher) == ("frontier00012", DEFAULT_PORT, "slurm")


def test_slurm_step_nodelist_and_tasks_per_node_format():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "16", "SLURM_TASKS_PER_NODE": "8(x2)",
           "SLURM_STEP_NODELIST": "nid[000101,000200]", "SLURM_JOB_NODELIST": "other1", "MASTER_PORT": "29600"}
    launch = detect_launch_env(env)
    assert launch.local_world_size == 8
    assert (launch.master_addr, launch.master_port) == ("nid000101", 29600)


def test_slurm_explicit_master_addr_wins():
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "a[1-2]", "MASTER_ADDR": "10.0.0.1"}
    assert detect_launch_env(env).master_addr == "10.0.0.1"


@pytest.mark.parametrize("nodelist, host", [
    ("nid[001-004,010]", "nid001"),
    ("nid001", "nid001"),
    ("gpu7,gpu8", "gpu7"),
    ("x1000c0s0b0n0", "x1000c0s0b0n0"),
    ("frontier[00012,00020-00023],login1", "frontier00012"),
    (" node[3-4] ", "node3"),
])
def test_first_host_of_nodelists(nodelist, host):
    assert first_host(nodelist) == host


def test_pals_on_aurora(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x4102c0s0b0n0.hsn.cm.aurora.alcf.anl.gov\nx4102c0s1b0n0.hsn.cm.aurora.alcf.anl.gov\n")
    env = {"PALS_RANKID": "13", "PMI_SIZE": "24", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "12",
           "PBS_NODEFILE": str(nodefile)}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (13, 24, 1, 12)
    assert launch.master_addr == "x4102c0s0b0n0.hsn.cm.aurora.alcf.anl.gov"
    assert launch.launcher == "pals"


def test_pals_without_world_size_says_how_to_launch():
    with pytest.raises(LaunchError, match="mpiexec -n"):
        detect_launch_env({"PALS_RANKID": "0"})


def test_pmi_mpich_and_intel_mpi():
    env = {"PMI_RANK": "3", "PMI_SIZE": "8", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4", "MASTER_ADDR": "h0"}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (3, 8, 3, 4)
    assert (launch.master_addr, launch.launcher) == ("h0", "pmi")


def test_pmi_without_nodefile_or_master_falls_back_to_localhost():
    launch = detect_launch_env({"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert launch.master_addr == "127.0.0.1"


def test_openmpi_variables(tmp_path):
    nodefile = tmp_path / "nodes"
    nodefile.write_text("\nhostA\nhostB\n")
    env = {"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "PBS_NODEFILE": str(nodefile)}
    launch = detect_launch_env(env)
    assert (launch.rank, launch.world_size, launch.local_rank, launch.local_world_size) == (6, 8, 2, 4)
    assert (launch.master_addr, launch.launcher) == ("hostA", "openmpi")


def test_non_integer_rank_is_a_launch_error():
    with pytest.raises(LaunchError, match="not an integer"):
        detect_launch_env({"RANK": "zero", "WORLD_SIZE": "2"})


def test_device_and_backend_choice():
    assert device_for(3, "cpu") == torch.device("cpu")
    assert device_for(3, "cuda") == torch.device("cuda", 3)
    assert device_for(0, "xpu") == torch.device("xpu", 0)
    # host tensors and objects still have gloo beside the device library
    assert backend_for(torch.device("cuda", 0)) == "cpu:gloo,cuda:nccl"
    assert backend_for(torch.device("xpu", 0)) == "cpu:gloo,xpu:xccl"
    assert backend_for(torch.device("cpu")) == "gloo"


def test_torchrun_restart_attempt_and_agent_store_are_read():
    env = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    launch = detect_launch_env(env)
    assert (launch.restart_count, launch.agent_store) == (3, True)
    assert (detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"}).restart_count,
            detect_launch_env({"RANK": "0", "WORLD_SIZE": "2"}).agent_store) == (0, False)


@pytest.mark.parametrize("env, problem", [
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "abc"}, "LOCAL_RANK='abc' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "x"}, "LOCAL_WORLD_SIZE='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT='x'"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc' is not an integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT 70000 is not a port"),
    ({"MASTER_PORT": "65536"}, "MASTER_PORT 65536 is not a port"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "x"}, "SLURM_LOCALID='x'"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "abc"}, "tasks per node 'abc'"),
    ({"RANK": "1", "WORLD_SIZE": "1"}, "rank 1 of a world of 1"),
    ({"RANK": "-1", "WORLD_SIZE": "1"}, "rank -1 of a world of 1"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 of a world of 2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "local rank 2 of 2"),
    ({"RANK": "1"}, "RANK=1 is set but WORLD_SIZE is not"),
    ({"PMI_RANK": "1"}, "PMI_RANK=1 is set but PMI_SIZE is not"),
    ({"OMPI_COMM_WORLD_RANK": "2"}, "OMPI_COMM_WORLD_RANK=2 is set but OMPI_COMM_WORLD_SIZE is not"),
])
def test_launcher_variables_that_cannot_be_right_are_one_line(env, problem):
    with pytest.raises(LaunchError, match=problem.replace("(", r"\(").replace("[", r"\[")) as err:
        detect_launch_env(env)
    assert "\n" not in str(err.value)


def test_an_sbatch_shell_is_one_process():
    # the batch script's own shell: SLURM_PROCID=0 without srun's task count
    assert detect_launch_env({"SLURM_PROCID": "0", "RANK": "0"}).launcher == "single"


def _slurm_rank(rank: int, port: int) -> dict[str, str]:
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank), "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_JOB_NODELIST": "localhost", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def test_a_master_port_another_process_holds_is_one_line():
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(LaunchError, match=rf"^MASTER_PORT {port} is in use on this host .*: set MASTER_PORT to "
                                              "a free port, the same on every rank$"):
            init_distributed(detect_launch_env(_slurm_rank(0, port)), torch.device("cpu"), timeout_s=5)


def test_a_rank_that_finds_no_rendezvous_says_where_it_looked():
    with socket.socket() as probe:  # a port no one listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(LaunchError, match=rf"^rank 1 found no rendezvous at 127.0.0.1:{port} within 1 s: check that "
                                          "rank 0 started"):
        init_distributed(detect_launch_env(_slurm_rank(1, port)), torch.device("cpu"), timeout_s=1)


def test_the_held_port_is_one_line_from_the_command(capsys, monkeypatch, tmp_path):
    from optimus.cli import main

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        for name, value in _slurm_rank(0, held.getsockname()[1]).items():
            monkeypatch.setenv(name, value)
        code = main(["train", "configs/mula-tiny-dense.yaml", "--parallel.dp_shard=2", "--train.max_steps=1",
                     f"--run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip().splitlines()  # the batch line, then the error
    assert code == 2 and err[-1].startswith("optimus train: error: MASTER_PORT") and "is in use" in err[-1]
    assert not any("Traceback" in line for line in err)


def test_an_empty_launcher_variable_takes_its_default():
    """A job script that exports LOCAL_RANK= (empty) means unset: the default applies, not 'not an integer'."""
    launch = detect_launch_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "", "MASTER_PORT": ""})
    assert (launch.local_rank, launch.master_port) == (1, DEFAULT_PORT)


def test_an_agent_store_variable_of_false_is_read_as_false():
    """torchrun writes TORCHELASTIC_USE_AGENT_STORE=False when its agent hosts no store: only "True" means one."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"}
    assert detect_launch_env(env).agent_store is False


class _RecordedGroup:
    """Stands in for torch.distributed's store and group calls: records what init_distributed asked for."""

    def __init__(self, monkeypatch):
        from optimus.parallel import launch as launch_module

        self.stores, self.prefixes, self.groups = [], [], []
        monkeypatch.setattr(launch_module.dist, "is_initialized", lambda: False)
        monkeypatch.setattr(launch_module, "rendezvous_store",
                            lambda launch, is_master, timeout_s: self.stores.append((launch.rank, is_master)) or "tcp")
        monkeypatch.setattr(launch_module.dist, "PrefixStore", lambda prefix, store: self.prefixes.append(prefix)
                            or f"{prefix}@{store}")
        monkeypatch.setattr(launch_module.dist, "init_process_group", lambda **kwargs: self.groups.append(kwargs))


def test_each_torchrun_restart_attempt_joins_under_its_own_key_prefix(monkeypatch):
    """Under torchrun's agent store (kept across --max-restarts) a restarted attempt must not read the dead
    attempt's keys: attempt N joins under optimus/attempt-N."""
    recorded = _RecordedGroup(monkeypatch)
    for attempt in (0, 1):
        env = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": str(attempt),
               "TORCHELASTIC_USE_AGENT_STORE": "True"}
        init_distributed(detect_launch_env(env), torch.device("cpu"), timeout_s=5)
    assert recorded.prefixes == ["optimus/attempt-0", "optimus/attempt-1"]
    assert recorded.stores == [(1, False), (1, False)]  # the agent hosts the store: no worker does
    assert [group["store"] for group in recorded.groups] == ["optimus/attempt-0@tcp", "optimus/attempt-1@tcp"]


def test_only_global_rank_zero_hosts_the_rendezvous_on_a_multi_node_job(monkeypatch):
    """Rank 8 is local rank 0 of the second node: it joins rank 0's store, it does not open one of its own."""
    recorded = _RecordedGroup(monkeypatch)
    for rank, local in ((8, 0), (0, 0)):
        env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "16", "SLURM_LOCALID": str(local),
               "SLURM_NTASKS_PER_NODE": "8", "SLURM_JOB_NODELIST": "node[1-2]"}
        init_distributed(detect_launch_env(env), torch.device("cpu"), timeout_s=5)
    assert recorded.stores == [(8, False), (0, True)]
    assert [(group["rank"], group["world_size"]) for group in recorded.groups] == [(8, 16), (0, 16)]


@pytest.mark.parametrize("exit_code, barrier", [(0, True), (1, False), (2, False)])
def test_leaving_waits_for_the_peers_only_after_a_clean_run(monkeypatch, exit_code, barrier):
    """A clean exit meets the other ranks at a barrier before the group is destroyed; a failed one leaves at once
    (its peers may be gone, so a barrier could wait forever). The process exits with the code either way."""
    from optimus.parallel import launch as launch_module
    from optimus.parallel.launch import leave_distributed

    calls = []

    class Exited(Exception):
        pass

    def exit_now(code):
        calls.append(("exit", code))
        raise Exited

    monkeypatch.setattr(launch_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(launch_module.dist, "barrier", lambda: calls.append(("barrier",)))
    monkeypatch.setattr(launch_module.dist, "destroy_process_group", lambda: calls.append(("destroy",)))
    monkeypatch.setattr(launch_module.os, "_exit", exit_now)
    with pytest.raises(Exited):
        leave_distributed(exit_code)
    assert calls == [*([("barrier",)] if barrier else []), ("destroy",), ("exit", exit_code)]


def test_pals_and_pmi_fall_back_to_their_other_names_for_sizes_and_local_ranks():
    pals = detect_launch_env({"PALS_RANKID": "7", "PALS_SIZE": "24", "PALS_LOCAL_RANKID": "1", "PMI_LOCAL_SIZE": "6"})
    assert (pals.rank, pals.world_size, pals.local_rank, pals.local_world_size) == (7, 24, 1, 6)
    pmi = detect_launch_env({"PMI_RANK": "6", "PMI_SIZE": "8", "PMI_LOCAL_RANK": "2", "PMI_LOCAL_SIZE": "4"})
    assert (pmi.rank, pmi.world_size, pmi.local_rank, pmi.local_world_size) == (6, 8, 2, 4)
