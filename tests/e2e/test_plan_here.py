"""`optimus plan --cluster here`, `--calibrate` and `optimus tune` end to end, on a machine entry written by the test.

The machine entry (peaks, bandwidth, memory, gloo alpha-beta) is normally measured once per host; here the tests
write one by hand into a private XDG cache so they do not spend a minute measuring, and so the memory the
planner sees is known: small enough that some layouts are pruned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optimus.plan.here import host_key

from tests.e2e.conftest import cli_env, run_cli, tiny_config
from tests.helpers.cli import run_in_process as in_process


def _machine(memory_gib: float) -> dict:
    """A `here` cache entry as current code writes it (an older one is partly re-measured: a minute of gloo)."""
    from optimus.plan.calibrate_collectives import COLLECTIVE_TIMING
    from optimus.plan.here import HOST_MEMORY

    fit = {"alpha_us": 200.0, "beta_gb_s": 1.0, "worst_relative_error": 0.1}
    return {"cpu": "test CPU", "cores": 2, "memory_bytes": int(memory_gib * 1024**3), "fp32_flops_per_thread": 2e10,
            "bf16_flops_per_thread": 2e8, "fp32_flops_all_cores": 3.6e10, "bf16_flops_all_cores": 3.6e8,
            "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
            "copy_gb_s_all_cores": 10.0, "fresh_page_s_per_byte": 0.0, "host_memory": HOST_MEMORY,
            "collectives": {"timing": COLLECTIVE_TIMING, "rows": [], "fits": {"2": fit, "4": fit}},
            "measured_at": "by the test"}


@pytest.fixture
def here_cache(tmp_path, monkeypatch):
    cache = tmp_path / "xdg"
    (cache / "optimus").mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))

    def write(memory_gib: float, load: float | None = None) -> None:
        machine = _machine(memory_gib) | ({"load_at_measure": load} if load is not None else {})
        (cache / "optimus" / "plan_here.json").write_text(json.dumps({host_key(): {"machine": machine}}))
    return write


def test_plan_here_uses_the_measured_machine_and_says_it_is_not_calibrated(here_cache, config_file, tmp_path):
    here_cache(memory_gib=24)
    out = tmp_path / "plan.json"
    result = run_cli("plan", str(config_file), "--cluster", "here", "--devices", "2", "--json", str(out))
    assert result.returncode == 0, result.stderr
    assert "valid layouts of 2 here devices" in result.stdout
    assert "not measured: run `optimus plan CONFIG --cluster here --devices N --calibrate`" in result.stderr
    entries = json.loads(out.read_text())
    assert entries and all(e["fits"] for e in entries)  # 12 GiB per rank holds the tiny model in any layout
    # the measured peak: 2e10 FLOP/s per thread, one core per rank
    assert all(0 < e["mfu"] <= 1 for e in entries)


@pytest.mark.parametrize("load, busy", [(3.5, True), (0.4, False)])
def test_a_plan_from_timings_taken_on_a_busy_host_says_so(here_cache, config_file, load, busy, capsys):
    here_cache(memory_gib=24, load=load)
    code, _, err = in_process(capsys, "plan", str(config_file), "--cluster", "here", "--devices", "2")
    assert code == 0, err
    note = "the host was busy when it was measured (by the test) (load 3.5 on 2 cores)"
    assert (note in err) is busy, err
    assert ("--calibrate` again on a quiet host" in err) is busy


def test_a_lone_rank_is_planned_on_its_threads_and_told_when_the_calibration_ran_on_fewer(here_cache, config_file,
                                                                                          tmp_path):
    """--devices 1 under OMP_NUM_THREADS=2 (make train's setting) prices both cores; op classes calibrated on one
    thread a rank get a line saying how to time them on two."""
    here_cache(memory_gib=24)
    cache = Path(os.environ["XDG_CACHE_HOME"]) / "optimus" / "plan_here.json"
    entries = json.loads(cache.read_text())
    entries[host_key()].update(efficiency={"dense_gemm": 0.5}, calibrated_threads=1)
    cache.write_text(json.dumps(entries))
    steps = {}
    for threads in ("1", "2"):
        out = tmp_path / f"plan{threads}.json"
        result = subprocess.run([sys.executable, "-m", "optimus", "plan", str(config_file), "--cluster", "here",
                                 "--devices", "1", "--json", str(out)], capture_output=True, text=True, timeout=240,
                                env=dict(cli_env(), OMP_NUM_THREADS=threads))
        assert result.returncode == 0, result.stderr
        steps[threads] = json.loads(out.read_text())[0]["step_time_s"]
        warned = "the op classes were calibrated on 1 thread a rank and this job's ranks run 2" in result.stderr
        assert warned == (threads == "2")
    assert steps["2"] < steps["1"]


@pytest.mark.slow  # measures this machine for real: 1-3 minutes on an idle 2-core CPU (190 s on the AVX2 EPYC)
@pytest.mark.timeout(900)  # and more beside the chaos soak in make test-slow (past 300 s, 2026-11-30)
def test_calibrate_times_the_configured_layouts_micro_batch_and_dtensor_dispatch(here_cache, config_file):
    """A config that sets tp 2 is calibrated at its own layout (it once failed: validated as one rank), and the
    calibration prints what a DTensor operator costs."""
    here_cache(memory_gib=24)
    result = run_cli("plan", str(config_file), "--cluster", "here", "--devices", "2", "--calibrate",
                     "--parallel.tp=2", timeout=800)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "us more per DTensor operator (under tp)" in result.stdout
    assert "valid layouts of 2 here devices" in result.stdout


@pytest.mark.slow  # two real 2-rank trials: ~40 s on an idle 2-core CPU, minutes when it is shared
def test_tune_prunes_what_does_not_fit_runs_trials_and_writes_the_best(here_cache, tmp_path, token_dir):
    # 0.2 GiB for 2 ranks: 0.09 GiB each at 90%; the tiny model's layouts need 0.07-0.17 GiB by the planner's model
    here_cache(memory_gib=0.2)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(token_dir, model={"n_layers": 2})))
    out = tmp_path / "tune"
    result = run_cli("tune", str(config), "--trials", "2", "--ranks", "2", "--steps", "1", "--warmup", "1",
                     "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "trials.jsonl").read_text().splitlines()]
    pruned = [r for r in rows if r["trial"] is None]
    trials = [r for r in rows if r["trial"] is not None]
    assert pruned and all(r["status"].startswith("pruned: predicted") for r in pruned)
    assert all(r["predicted_memory_gib"] > 0.09 for r in pruned)
    assert all(r["predicted_memory_gib"] <= 0.09 for r in trials)
    assert len(trials) == 2 and {r["trial"] for r in trials} == {0, 1}
    assert all(r["key"] not in {p["key"] for p in pruned} for r in trials)  # nothing infeasible was launched
    ran = [r for r in trials if r["status"] == "ok"]
    assert ran and all(r["measured_tokens_per_s"] > 0 and r["measured_step_s"] > 0 for r in ran)
    best = yaml.safe_load((out / "best.yaml").read_text())
    fastest = max(ran, key=lambda r: r["measured_tokens_per_s"])["layout"]
    assert {k: best["parallel"][k] for k in ("tp", "pp", "ep", "dp_shard")} == \
        {k: fastest[k] for k in ("tp", "pp", "ep", "dp_shard")}
    assert best["train"]["micro_batch_size"] == fastest["micro_batch_size"]


@pytest.mark.slow  # one real 2-rank trial: ~20 s on an idle 2-core CPU
def test_tune_starts_every_trial_with_the_launcher_given(here_cache, tmp_path, token_dir):
    here_cache(memory_gib=24)
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(tiny_config(token_dir, model={"n_layers": 2})))
    # what srun or mpiexec would be on a cluster: torchrun starting the ranks itself, after leaving a mark
    launcher = tmp_path / "launch.sh"
    launcher.write_text(f'#!/bin/sh\ntouch "{tmp_path}/launched"\n'
                        f'exec {sys.executable} -m torch.distributed.run --standalone --nproc-per-node 2 --no-python '
                        '"$@"\n')
    launcher.chmod(0o755)
    out = tmp_path / "tune"
    result = run_cli("tune", str(config), "--trials", "1", "--ranks", "2", "--steps", "1", "--warmup", "1",
                     "--launcher", str(launcher), "--out", str(out), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    trials = [r for r in map(json.loads, (out / "trials.jsonl").read_text().splitlines()) if r["trial"] is not None]
    assert (tmp_path / "launched").exists() and len(trials) == 1
    assert trials[0]["status"] == "ok" and trials[0]["measured_tokens_per_s"] > 0, trials[0]["status"]
    assert sorted(p.name for p in out.iterdir()) == ["best.yaml", "trials.jsonl"]  # the trial's run folder is gone


@pytest.mark.parametrize("args,needle", [
    (["--trials", "0"], "--trials must be at least 1 (got 0)"),
    (["--trials", "2", "--ranks", "0"], "--ranks must be at least 1 (got 0)"),
    (["--trials", "1", "--trial-timeout", "nan"], "--trial-timeout must be a positive number of seconds (got nan)"),
    (["--trials", "1", "--launcher", " "], "or leave it out to launch on this node"),
    (["--trials", "1", "--launcher", "no-such-srun -N 2"],
     "'no-such-srun' is not a program on PATH: run the search where it is (inside the allocation), or give its "
     "full path"),
])
def test_tune_bad_flags_are_one_line_and_exit_2(config_file, args, needle, capsys):
    code, _, err = in_process(capsys, "tune", str(config_file), *args)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and err.strip().endswith(needle), err


def test_a_launcher_that_starts_another_rank_count_than_ranks_is_one_line(config_file, capsys, tmp_path):
    srun = tmp_path / "srun"  # only its name and flags are read: nothing starts
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(0o755)
    code, _, err = in_process(capsys, "tune", str(config_file), "--trials", "1", "--ranks", "8",
                              "--launcher", f"{srun} -N 2 --ntasks-per-node 8", "--out", str(tmp_path / "tune"))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.strip().endswith("starts 16 ranks but --ranks is 8: give --ranks 16 (each trial's layout and prices "
                                "are for that many devices), or a launcher that starts 8"), err


def test_tune_with_more_ranks_than_cores_says_the_trials_time_share_them(here_cache, config_file, capsys, tmp_path):
    from optimus.plan.here import cores as available_cores

    here_cache(memory_gib=0.01)  # nothing fits: the search ends at once, after the warning
    cores = available_cores()
    code, _, err = in_process(capsys, "tune", str(config_file), "--trials", "1", "--ranks", str(2 * cores),
                              "--out", str(tmp_path / "tune"))
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"warning: --ranks {2 * cores} on {cores} cores: the ranks take turns on the cores")
    assert lines[-1].startswith(f"optimus tune: error: no layout of {2 * cores} ranks")
