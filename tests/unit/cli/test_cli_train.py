"""`optimus train`'s own flags: bad values end in one line and exit code 2 before any work; `optimus chaos`'s
default fault kinds and its exit code (the harness itself replaced by a stand-in)."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.cli import main

CONFIG = str(Path(__file__).resolve().parents[3] / "configs" / "mula-tiny-dense.yaml")


@pytest.mark.parametrize("memory", ["-1", "0", "nan", "inf"])
def test_a_dry_run_against_a_device_memory_that_is_not_positive_is_one_line(memory, capsys):
    code = main(["train", CONFIG, "--dry-run", "--world-size", "1", "--device-memory-gb", memory])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("optimus train: error: --device-memory-gb must be a positive number of GiB (got ")


def test_world_size_without_dry_run_is_refused_before_training(tmp_path, capsys):
    run = tmp_path / "run"
    code = main(["train", CONFIG, "--world-size", "4", f"--run.dir={run}", "--train.max_steps=1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith("optimus train: error: --world-size 4 applies with --dry-run only: add --dry-run, or ")
    assert not run.exists()  # refused before the trainer made anything


def _chaos_stand_in(monkeypatch, weights_equal: bool) -> list[dict]:
    """run_chaos replaced by a stand-in that records what it was asked and reports one recovered fault."""
    from optimus.resilience import chaos

    asked: list[dict] = []

    def run_chaos(config, overrides, out, faults, ranks, kinds, **options):
        asked.append(dict(ranks=ranks, kinds=kinds))
        fault = chaos.Fault(kind=kinds[0], at_step=2, injected_at_step=2, recovered=True, recovery_s=1.0,
                            steps_redone=1)
        return chaos.ChaosReport(config=config, ranks=ranks, max_steps=8, faults=[fault], weights_equal=weights_equal,
                                 tensors_compared=3, first_difference="" if weights_equal else "w (max abs 1)")

    monkeypatch.setattr(chaos, "run_chaos", run_chaos)
    return asked


@pytest.mark.parametrize("weights_equal, code", [(True, 0), (False, 1)])
def test_chaos_exits_1_when_the_run_did_not_survive(weights_equal, code, monkeypatch, tmp_path, capsys):
    """A scheduler or CI job reads the verdict from the exit code: final weights that differ from the undisturbed
    run's are a failed recovery (exit 1), not a success."""
    _chaos_stand_in(monkeypatch, weights_equal)
    assert main(["chaos", CONFIG, "--faults", "1", "--out", str(tmp_path / "out")]) == code
    assert capsys.readouterr().out.count("every fault survived: " + ("yes" if weights_equal else "NO")) == 1


@pytest.mark.parametrize("ranks", [1, 2])
def test_chaos_draws_from_every_fault_kind_the_rank_count_allows(ranks, monkeypatch, tmp_path):
    """Without --kinds: two or more ranks (under torchrun) also get the in-job faults (kill_rank, hang_rank); one
    process gets every kind but those."""
    from optimus.resilience.chaos import FAULT_KINDS, IN_JOB_KINDS

    asked = _chaos_stand_in(monkeypatch, weights_equal=True)
    assert main(["chaos", CONFIG, "--faults", "1", "--ranks", str(ranks), "--out", str(tmp_path / "out")]) == 0
    expected = list(FAULT_KINDS) if ranks > 1 else [k for k in FAULT_KINDS if k not in IN_JOB_KINDS]
    assert asked == [dict(ranks=ranks, kinds=expected)]
    assert ("kill_rank" in expected and "hang_rank" in expected) is (ranks > 1)


@pytest.mark.parametrize("world_size", ["0", "-2"])
def test_a_dry_run_for_no_ranks_is_one_line(world_size, capsys):
    assert main(["train", CONFIG, "--dry-run", "--world-size", world_size]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["optimus train: error: --world-size must be at least 1"]


@pytest.mark.parametrize("flags", [["--faults", "0"], ["--ranks", "0"], ["--ranks", "-1"]])
def test_chaos_with_no_fault_or_no_rank_is_one_line_before_any_run(flags, capsys, monkeypatch):
    def run_chaos(*args, **kwargs):
        raise AssertionError("the harness ran")

    monkeypatch.setattr("optimus.resilience.chaos.run_chaos", run_chaos)
    assert main(["chaos", CONFIG, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["optimus chaos: error: --faults and --ranks must be at least 1"]
