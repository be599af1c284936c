"""optimus tune's search: optuna over the planner's feasible layouts; infeasible ones never reach the runner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optimus.config import ConfigError, load_config
from optimus.plan.here import here_cluster
from optimus.plan.tune import (TrialRun, format_trials, launcher_ranks, layout_key, layout_overrides, run_trial,
                                trial_cluster, trial_command, tune)
from optimus.train import hardware
from optimus.train.hardware import LocalAccelerators, local_accelerators, probe_local_accelerators

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _cluster(memory_gib: float, ranks: int = 2):
    fit = {"alpha_us": 200.0, "beta_gb_s": 1.0, "worst_relative_error": 0.1}
    machine = {"cpu": "test CPU", "cores": 2, "memory_bytes": int(memory_gib * 1024**3), "fp32_flops_per_thread": 2e10,
               "bf16_flops_per_thread": 2e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
               "copy_gb_s_all_cores": 10.0, "collectives": {"timing": "mean call", "rows": [], "fits": {"2": fit}}, "measured_at": "test"}
    return here_cluster({"machine": machine}, ranks)


def test_tune_launches_only_feasible_layouts_records_every_trial_and_keeps_the_fastest(tmp_path):
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    launched = []

    def fake_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        # a deterministic "measurement" that disagrees with the planner: favours large micro-batches and tp
        launched.append(layout_key(candidate))
        lay = candidate.layout()
        rate = 100.0 * lay["micro_batch_size"] + 7.0 * lay["tp"] + lay["ep"]
        return TrialRun("ok", rate, 512 / rate, [512 / rate])

    best, records = tune(config, "unused.yaml", [], _cluster(1.16), 2, 6, tmp_path, {}, runner=fake_run,
                         say=lambda line: None)
    # 1.16 GiB for 2 ranks: 0.52 GiB each at 90%, about the median layout's need (0.41-0.81 GiB)
    pruned = {r["key"] for r in records if r["trial"] is None}
    trials = [r for r in records if r["trial"] is not None]
    assert pruned, "the memory limit should rule some layouts out"
    assert len(trials) == 6 and not set(launched) & pruned
    assert len(launched) == len(set(launched))  # a repeated suggestion is not run again
    assert records == [json.loads(line) for line in (tmp_path / "trials.jsonl").read_text().splitlines()]
    fastest = max((r for r in trials if r["status"].startswith("ok")), key=lambda r: r["measured_tokens_per_s"])
    assert layout_key(best) == fastest["key"]
    planner_best = min((r for r in trials), key=lambda r: r["predicted_step_s"])
    assert trials[0]["predicted_step_s"] == pytest.approx(planner_best["predicted_step_s"])  # starts from the plan
    assert "--parallel.ep=" + str(best.config.parallel.ep) in layout_overrides(best)


def test_each_layout_has_its_own_key_and_its_overrides_select_exactly_it():
    """The search's categorical is the key and a trial runs the overrides: two layouts that differ only in how
    tokens reach their experts must neither share a key nor run the config's dispatch instead of their own."""
    from optimus.plan.search import plan

    path = CONFIGS / "mula-tiny-moe.yaml"
    base = ["--train.seq_len=64", "--model.n_layers=2"]
    candidates = plan(load_config(path, base), _cluster(64, ranks=4), 4)
    assert {c.layout()["ep_dispatch"] for c in candidates} >= {"all_to_all", "allgather"}
    assert len({layout_key(c) for c in candidates}) == len(candidates)
    for c in candidates:
        again = load_config(path, [*base, *layout_overrides(c)])
        assert again.parallel == c.config.parallel
        assert (again.train.micro_batch_size, again.train.activation_checkpointing) == \
            (c.config.train.micro_batch_size, c.config.train.activation_checkpointing)


def test_the_trials_table_prints_each_layout_whole():
    row = {"predicted_tokens_per_s": 1000.0, "measured_tokens_per_s": 900.0, "predicted_memory_gib": 0.5,
           "status": "ok"}
    keys = [f"dp_r1-dp_s4-tp1-pp2-ep2-mbs1-selective_ops-zero1-interleaved_1f1b-{d}"
            for d in ("all_to_all", "allgather")]
    table = format_trials([{**row, "trial": None, "key": "pruned"},
                           *({**row, "trial": i, "key": k} for i, k in enumerate(keys))])
    assert len(table.splitlines()) == 3 and all(k in table for k in keys) and "pruned" not in table


def test_tune_with_nothing_that_fits_is_one_clear_error(tmp_path):
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64"])
    with pytest.raises(ConfigError, match="no layout of 2 ranks fits this machine's memory"):
        tune(config, "unused.yaml", [], _cluster(0.01), 2, 2, tmp_path, {}, runner=None, say=lambda line: None)


def test_tune_held_to_some_layouts_runs_only_those(tmp_path):
    from optimus.plan.search import parse_only

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    launched = []

    def fake_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        launched.append(candidate.layout())
        return TrialRun("ok", 100.0, 5.12, [5.12])

    tune(config, "unused.yaml", [], _cluster(64), 2, 3, tmp_path, {}, runner=fake_run, say=lambda line: None,
         only=parse_only(["shard_mode=zero2"]))
    assert launched and all(lay["shard_mode"] == "zero2" for lay in launched)
    with pytest.raises(ConfigError, match="within --only"):
        tune(config, "unused.yaml", [], _cluster(64), 2, 3, tmp_path, {}, runner=fake_run, say=lambda line: None,
             only=parse_only(["tp=4"]))


H100_NODE = LocalAccelerators("cuda", "NVIDIA H100 80GB HBM3", 8, 79.1)


@pytest.mark.parametrize("name, preset", [("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA H200", "h200"),
                                          ("NVIDIA A100-SXM4-80GB", "a100"), ("AMD Instinct MI250X", "frontier"),
                                          ("Intel(R) Data Center GPU Max 1550", "aurora")])
def test_trials_on_accelerators_are_priced_as_one_node_of_their_kind_with_the_memory_they_report(name, preset):
    cluster = trial_cluster(None, 4, LocalAccelerators("cuda", name, 8, 61.5))
    assert (cluster.name, cluster.devices_per_node, cluster.memory_gb) == (preset, 4, 61.5)
    # a cluster named on the command line is priced the same way: this node's ranks, their memory
    named = trial_cluster("lumi", 2, LocalAccelerators("cuda", name, 8, 61.5))
    assert (named.name, named.devices_per_node, named.memory_gb) == ("lumi", 2, 61.5)


def test_on_a_cpu_the_trials_are_priced_here():
    assert trial_cluster(None, 2, None) is None and trial_cluster("here", 2, None) is None


def test_prices_for_other_devices_than_the_trials_train_on_are_refused():
    with pytest.raises(ConfigError, match="torch sees no GPU or XPU here"):
        trial_cluster("h100", 2, None)
    with pytest.raises(ConfigError, match="--cluster here prices this machine's CPU"):
        trial_cluster("here", 2, H100_NODE)
    with pytest.raises(ConfigError, match="ask for at most 8"):
        trial_cluster(None, 16, H100_NODE)
    with pytest.raises(ConfigError, match="NVIDIA L40S matches no cluster preset"):
        trial_cluster(None, 1, LocalAccelerators("cuda", "NVIDIA L40S", 4, 44.5))


def test_the_probe_in_a_child_process_sees_what_this_process_sees(monkeypatch):
    monkeypatch.setattr(hardware, "accelerator_runtime_built", lambda: True)  # the child runs whatever this torch is
    assert probe_local_accelerators() == local_accelerators()


def test_a_torch_without_an_accelerator_runtime_starts_no_child(monkeypatch):
    monkeypatch.setattr(hardware, "accelerator_runtime_built", lambda: False)
    monkeypatch.setattr(hardware.subprocess, "run", lambda *args, **kwargs: pytest.fail("a child was started"))
    assert probe_local_accelerators() is None


def test_tune_on_accelerators_prunes_by_the_memory_the_devices_report(tmp_path):
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    # 0.6 GiB devices: 0.54 GiB at 90%, about the median layout's need on an H100 node's prices (0.36-0.85 GiB)
    cluster = trial_cluster(None, 2, LocalAccelerators("cuda", "NVIDIA H100 80GB HBM3", 2, 0.6))
    launched = []

    def fake_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        launched.append(candidate.memory_bytes / 1024**3)
        return TrialRun("ok", 100.0, 5.12, [5.12])

    _, records = tune(config, "unused.yaml", [], cluster, 2, 4, tmp_path, {}, runner=fake_run, say=lambda line: None)
    pruned = [r["predicted_memory_gib"] for r in records if r["trial"] is None]
    assert pruned and min(pruned) > 0.54 and launched and max(launched) <= 0.54
    assert all("> 0.54 GiB" in r["status"] for r in records if r["trial"] is None)


@pytest.mark.parametrize("found, argv, says", [
    (None, ["--cluster", "h100"], "torch sees no GPU or XPU here"),
    (H100_NODE, ["--cluster", "here"], "--cluster here prices this machine's CPU"),
    (H100_NODE, ["--ranks", "16"], "ask for at most 8"),
])
def test_tune_refuses_prices_for_other_devices_in_one_line_before_any_trial(found, argv, says, monkeypatch, capsys,
                                                                             tmp_path):
    from optimus.cli import main

    monkeypatch.setattr("optimus.train.hardware.probe_local_accelerators", lambda: found)
    code = main(["tune", str(CONFIGS / "mula-tiny-moe.yaml"), "--trials", "1", "--out", str(tmp_path / "t"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("launcher, ranks", [
    ("srun -N 2 --ntasks-per-node 8", 16), ("srun --nodes=2 --ntasks-per-node=8 --cpu-bind=cores", 16),
    ("srun -n16 -N 2", 16), ("/opt/slurm/bin/srun --ntasks 24", 24), ("mpiexec -n 24 --ppn 12", 24),
    ("mpirun -np 8", 8),
    ("srun -N 2-4 --ntasks-per-node 8", None), ("srun -N 2", None), ("mpiexec --ppn 12", None),
    ("my-launcher -n 4", None),
])
def test_the_rank_count_a_launcher_starts_where_its_flags_say(launcher, ranks):
    assert launcher_ranks(launcher.split()) == ranks


@pytest.mark.parametrize("ranks, refused", [("2", True), ("8", False)])
def test_a_launcher_that_starts_another_rank_count_than_ranks_is_one_line(ranks, refused, monkeypatch, capsys,
                                                                          tmp_path):
    """`--launcher 'mpirun -np 8'` with `--ranks 2` would train on 8 ranks layouts priced for 2: refused in one line
    naming both counts, before any trial (the search is a stand-in that records whether it was reached; priced as
    h100 nodes, so nothing on this machine is measured)."""
    import stat

    from optimus.cli import main

    mpirun = tmp_path / "bin" / "mpirun"  # a program of that name on the given path: never run here
    mpirun.parent.mkdir()
    mpirun.write_text("#!/bin/sh\nexit 1\n")
    mpirun.chmod(mpirun.stat().st_mode | stat.S_IEXEC)
    searched = []

    def stand_in(*args, **kwargs):
        searched.append(args[4])  # the ranks the trials are priced for
        return None, []

    monkeypatch.setattr("optimus.plan.tune.tune", stand_in)
    monkeypatch.setattr("optimus.train.hardware.probe_local_accelerators", lambda: None)
    code = main(["tune", str(CONFIGS / "mula-tiny-moe.yaml"), "--trials", "1", "--ranks", ranks,
                 "--launcher", f"{mpirun} -np 8", "--cluster", "h100", "--out", str(tmp_path / "t")])
    captured = capsys.readouterr()
    if refused:
        err = captured.err.strip()
        assert code == 2 and len(err.splitlines()) == 1, err
        assert f"--launcher '{mpirun} -np 8' starts 8 ranks but --ranks is 2: give --ranks 8" in err
        assert searched == []
    else:
        assert searched == [8]


def test_under_a_launcher_the_trials_are_priced_as_whole_nodes_of_the_devices():
    nodes = trial_cluster(None, 16, H100_NODE, launcher=True)
    assert (nodes.name, nodes.devices_per_node, nodes.memory_gb) == ("h100", 8, 79.1)
    assert trial_cluster(None, 4, H100_NODE, launcher=True).devices_per_node == 4  # part of one node
    # started from a node without the devices (a login node): the named cluster's own node and memory
    remote = trial_cluster("aurora", 24, None, launcher=True)
    assert (remote.devices_per_node, remote.memory_gb) == (12, 64)
    with pytest.raises(ConfigError, match="--ranks 12 is not whole nodes of 8 devices"):
        trial_cluster(None, 12, H100_NODE, launcher=True)


def test_a_trial_runs_under_the_launcher_with_its_run_folder_under_the_search(tmp_path):
    import stat
    import sys

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    from optimus.plan.search import plan

    candidate = plan(config, _cluster(64), 2)[0]
    # a stand-in for srun: records what it was asked to start and logs two steps as the trainer would
    launcher = tmp_path / "fake-srun"
    launcher.write_text('#!/bin/sh\necho "$@" > "$(dirname "$0")/started"\n'
                        'for a in "$@"; do case $a in --run.dir=*) d=${a#--run.dir=};; esac; done\n'
                        'mkdir -p "$d" && echo "$d" > "$(dirname "$0")/run_dir"\n'
                        'printf \'{"step": 1, "tokens_per_s": 50}\\n{"step": 2, "tokens_per_s": 100}\\n\' '
                        '> "$d/metrics.jsonl"\n')
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "tune"
    out.mkdir()
    result = run_trial("c.yaml", [], candidate, 16, 1, 1, {}, 60.0, launcher=[str(launcher), "-N", "2"],
                       work_dir=out)
    assert result.status == "ok" and result.tokens_per_s == 100.0  # the step after the warm-up
    started = (tmp_path / "started").read_text().split()
    assert started[:6] == ["-N", "2", sys.executable, "-m", "optimus", "train"]
    assert "--parallel.ep=" + str(candidate.config.parallel.ep) in started
    assert Path((tmp_path / "run_dir").read_text().strip()).parent.parent == out  # seen by every node
    assert not list(out.iterdir())  # and removed after the trial
    assert trial_command(2, None)[-4:] == ["optimus", "launch", "--nproc-per-node=2", "train"]


def test_a_layout_suggested_again_is_not_run_again_but_recorded_as_its_first_measurement(tmp_path):
    """The sampler may suggest a layout it has tried: that trial reuses the first run's measurement (a real run
    costs minutes) and says so, so every layout runs at most once however many trials are asked for."""
    from optimus.plan.search import parse_only

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    launched = []

    def fake_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        launched.append(layout_key(candidate))
        rate = 100.0 + len(launched)  # each run measures anew: a repeat would read another rate
        return TrialRun("ok", rate, 512 / rate, [512 / rate])

    only = parse_only(["shard_mode=zero2", "tp=1", "pp=1", "ep=1", "dp_replicate=1"])
    _, records = tune(config, "unused.yaml", [], _cluster(64), 2, 6, tmp_path, {}, runner=fake_run,
                      say=lambda line: None, only=only)
    trials = [r for r in records if r["trial"] is not None]
    assert len(trials) == 6 and len(launched) == len(set(launched)) < 6
    first = {}
    for r in trials:
        if r["key"] in first:
            assert r["status"] == "ok (repeat: measured before)"
            assert r["measured_tokens_per_s"] == first[r["key"]]["measured_tokens_per_s"]
        else:
            assert r["status"] == "ok"
            first[r["key"]] = r


def _fake_launcher(folder: Path, rates: list[float], code: int = 0, err: str = "") -> list[str]:
    """A stand-in for srun: logs one step a rate (steps 1, 2, ...) as the trainer would, says `err` on stderr and
    exits with `code`."""
    import stat

    lines = "".join(json.dumps({"step": i + 1, "tokens_per_s": r}) + "\\n" for i, r in enumerate(rates))
    launcher = folder / "fake-srun"
    launcher.write_text('#!/bin/sh\nfor a in "$@"; do case $a in --run.dir=*) d=${a#--run.dir=};; esac; done\n'
                        f"mkdir -p \"$d\" && printf '{lines}' > \"$d/metrics.jsonl\"\n"
                        f"echo '{err}' >&2\nexit {code}\n")
    launcher.chmod(launcher.stat().st_mode | stat.S_IEXEC)
    return [str(launcher)]


def test_a_trials_rate_is_the_median_of_its_measured_steps_and_each_steps_time_is_kept(tmp_path):
    """One slow or fast step does not decide a trial: its rate is the median of the steps after the warm-up, its
    step time the batch's tokens at that rate, and every measured step's time is recorded."""
    from optimus.plan.search import plan

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    candidate = plan(config, _cluster(64), 2)[0]
    tokens = candidate.config.train.global_batch_size * candidate.config.train.seq_len
    launcher = _fake_launcher(tmp_path, [10.0, 100.0, 400.0, 200.0])  # step 1 the warm-up
    result = run_trial("c.yaml", [], candidate, 2, 3, 1, {}, 60.0, launcher=launcher, work_dir=tmp_path)
    assert (result.status, result.tokens_per_s) == ("ok", 200.0)
    assert result.step_s == pytest.approx(tokens / 200.0)
    assert result.steps == pytest.approx([tokens / 100.0, tokens / 400.0, tokens / 200.0])


def test_a_trial_that_fails_after_logging_steps_is_a_failure_naming_its_last_error(tmp_path):
    """A run that logged steps and then crashed (out of memory at the last step, say) did not measure the layout:
    its exit code decides, and the status is the run's last error line."""
    from optimus.plan.search import plan

    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])
    candidate = plan(config, _cluster(64), 2)[0]
    launcher = _fake_launcher(tmp_path, [10.0, 100.0], code=1, err="RuntimeError: out of memory")
    result = run_trial("c.yaml", [], candidate, 2, 1, 1, {}, 60.0, launcher=launcher, work_dir=tmp_path)
    assert (result.status, result.tokens_per_s) == ("failed: RuntimeError: out of memory", 0.0)


@pytest.mark.parametrize("launcher, ranks", [("mpirun -np 8 -nolocal", 8), ("mpirun -np", None),
                                             ("mpiexec -n $RANKS", None)])
def test_a_launcher_flag_without_a_count_says_nothing_of_the_ranks(launcher, ranks):
    """A flag that only begins like the count's (-nolocal after -np 8) is not a count; a count flag with no value
    (the last word) or an unexpanded one counts no ranks: the check against --ranks is skipped, not failed."""
    assert launcher_ranks(launcher.split()) == ranks


def test_overwrite_lets_a_search_replace_the_earlier_one_and_its_best(tmp_path):
    """Without --overwrite an earlier search in --out is refused; with it the earlier best.yaml is removed before
    the first trial, so it never stands beside trials it did not come from."""
    from optimus.plan.tune import check_tune_out

    (tmp_path / "best.yaml").write_text("earlier search\n")
    with pytest.raises(ConfigError, match="already holds an earlier search \\(best.yaml\\)"):
        check_tune_out(tmp_path)
    check_tune_out(tmp_path, overwrite=True)
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])

    def fake_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        assert not (tmp_path / "best.yaml").exists()
        return TrialRun("ok", 100.0, 5.12, [5.12])

    tune(config, "unused.yaml", [], _cluster(64), 2, 1, tmp_path, {}, runner=fake_run, say=lambda line: None,
         overwrite=True)
    assert not (tmp_path / "best.yaml").exists()


@pytest.mark.parametrize("name", ["trials.jsonl", "best.yaml"])
def test_a_folder_where_the_search_writes_a_file_is_refused_even_with_overwrite(tmp_path, name):
    """Refused before any trial (cmd_tune checks first): --overwrite replaces files, never a folder."""
    from optimus.plan.tune import check_tune_out

    (tmp_path / name).mkdir()
    for overwrite in (False, True):
        with pytest.raises(ConfigError, match=f"holds a folder named '{name}' where the search writes a file: move"):
            check_tune_out(tmp_path, overwrite=overwrite)
    assert (tmp_path / name).is_dir()


def test_a_search_whose_every_trial_failed_has_no_best_layout(tmp_path):
    """A failed trial measured nothing (its 0 tokens/s is no score): with none run to the end there is no best."""
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.seq_len=64", "--model.n_layers=2"])

    def fake_run(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s):
        return TrialRun("failed: out of memory")

    best, records = tune(config, "unused.yaml", [], _cluster(64), 2, 2, tmp_path, {}, runner=fake_run,
                         say=lambda line: None)
    assert best is None and records and all(r["status"].startswith("failed") for r in records if r["trial"] is not None)


def test_tune_takes_no_warm_up_when_asked_for_none(monkeypatch, tmp_path):
    """--warmup 0 scores every measured step (a negative count is refused; none is not)."""
    from optimus.cli import main

    asked = []

    def stand_in(*args, **kwargs):
        asked.append(kwargs["warmup"])
        return None, []

    monkeypatch.setattr("optimus.plan.tune.tune", stand_in)
    monkeypatch.setattr("optimus.train.hardware.probe_local_accelerators", lambda: H100_NODE)
    main(["tune", str(CONFIGS / "mula-tiny-moe.yaml"), "--trials", "1", "--warmup", "0", "--out", str(tmp_path / "t")])
    assert asked == [0]


def test_tune_refuses_an_unbounded_trial_timeout_in_one_line(monkeypatch, capsys, tmp_path):
    from optimus.cli import main

    monkeypatch.setattr("optimus.plan.tune.tune", lambda *a, **k: pytest.fail("tuned past a bad --trial-timeout"))
    monkeypatch.setattr("optimus.train.hardware.probe_local_accelerators", lambda: H100_NODE)
    code = main(["tune", str(CONFIGS / "mula-tiny-moe.yaml"), "--trials", "1", "--trial-timeout", "inf",
                 "--out", str(tmp_path / "t")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--trial-timeout must be a positive number of seconds (got inf)" in err, err
