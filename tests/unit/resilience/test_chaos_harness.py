"""The chaos harness's own parts: the fault plan, the damage it does to a checkpoint, the weight comparison."""

from __future__ import annotations

import random

import pytest
import torch

from optimus.resilience.chaos import ChaosError, _damage, compare_weights, plan_faults


def test_plan_uses_every_kind_once_before_repeating_and_leaves_room_at_the_end():
    kinds = ["kill_group", "kill_rank", "nan_step"]
    plan = plan_faults(6, kinds, max_steps=20, rng=random.Random(3))
    assert sorted(f.kind for f in plan[:3]) == sorted(kinds) and sorted(f.kind for f in plan[3:]) == sorted(kinds)
    steps = [f.at_step for f in plan]
    assert steps == sorted(steps) and len(set(steps)) == 6 and max(steps) <= 20 - 3
    with pytest.raises(ChaosError, match="raise --train.max_steps"):
        plan_faults(10, kinds, max_steps=20, rng=random.Random(0))


@pytest.mark.parametrize("kind", ["truncate_newest", "bitflip_newest", "delete_newest"])
def test_damage_changes_the_largest_data_file(tmp_path, kind):
    (tmp_path / "__0_0.distcp").write_bytes(bytes(range(256)) * 64)
    (tmp_path / "__1_0.distcp").write_bytes(b"x" * 100)
    original = (tmp_path / "__0_0.distcp").read_bytes()
    note = _damage(tmp_path, kind, random.Random(0))
    assert "__0_0.distcp" in note and (tmp_path / "__1_0.distcp").read_bytes() == b"x" * 100
    target = tmp_path / "__0_0.distcp"
    assert not target.exists() if kind == "delete_newest" else target.read_bytes() != original


def test_weights_compare_bit_for_bit():
    a = {"w": torch.ones(3), "b": torch.zeros(2)}
    assert compare_weights(a, {k: v.clone() for k, v in a.items()}) == (True, 2, "")
    nudged = {"w": torch.ones(3) + 1e-7, "b": torch.zeros(2)}
    equal, _, first = compare_weights(a, nudged)
    assert not equal and first.startswith("w ")


def test_the_watched_run_reads_only_whole_lines_of_its_metrics(tmp_path):
    # the trainer may be writing the last line as chaos reads it (a 20-fault soak once read half a line)
    from optimus.resilience.chaos import _Run

    run = _Run(command=[], run_dir=tmp_path, ranks=1, env={}, log=tmp_path / "log")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.5}\n{"step": 3, "lo')
    assert run.last_step() == 2 and len(run.lines()) == 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "loss": 8.5}\n')
    assert run.last_step() == 2


def _watched(tmp_path, steps: int, script: str):
    """A _Run whose "training job" is `script` (python -c), with `steps` lines of metrics already written."""
    import sys

    from optimus.resilience.chaos import _Run

    (tmp_path / "metrics.jsonl").write_text("".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, steps + 1)))
    run = _Run(command=[sys.executable, "-c", script], run_dir=tmp_path, ranks=1, env={}, log=tmp_path / "log")
    run.launch()
    return run


def test_a_damage_fault_waits_until_a_checkpoint_lies_behind_the_run(tmp_path):
    """The newest checkpoint damaged while it is the only one (the SIGTERM's own at the step it was written) leaves
    nothing to fall back to: the harness waits for the run to train past a committed one first."""
    from optimus.resilience.chaos import Fault, _inject

    (tmp_path / "checkpoints" / "step-2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-2" / "COMMITTED").write_text("{}")
    run = _watched(tmp_path, 2, "import time; time.sleep(60)")
    try:
        with pytest.raises(ChaosError, match="waiting for step 1"):
            _inject(run, Fault(kind="bitflip_newest", at_step=1), random.Random(0), timeout=1.0)
        assert run.running()  # not struck: step 2 is the newest checkpoint and the run has not passed it
    finally:
        run.job.kill()
        run.job.wait()


def test_a_relaunch_that_fails_ends_the_wait_at_once_with_its_exit_code(tmp_path):
    """A relaunched job that exits non-zero (a damaged checkpoint with no earlier one, a bad config) is recorded as
    an unrecovered fault when it exits, not after the harness's whole timeout."""
    import time

    from optimus.resilience.chaos import Fault, _inject

    counter = tmp_path / "launches"
    script = (f"import pathlib, sys, time; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() "
              "else 0; p.write_text(str(n + 1)); time.sleep(60) if n == 0 else sys.exit(2)")
    run = _watched(tmp_path, 3, script)
    # The first job is up once its count is written whole: killed before that (an empty file), the relaunch would
    # crash on reading it (exit 1) instead of exiting with the code this test looks for.
    while not (counter.exists() and counter.read_text() == "1"):
        time.sleep(0.01)
    fault = Fault(kind="kill_group", at_step=2)
    started = time.monotonic()
    _inject(run, fault, random.Random(0), timeout=60.0)
    assert time.monotonic() - started < 20
    assert not fault.recovered and "the run ended with exit code 2 instead of training again" in fault.note


@pytest.mark.parametrize("chaos_weight, equal", [(0.0, True), (1.0, False)])
def test_the_verdict_compares_the_run_under_faults_with_the_reference(tmp_path, monkeypatch, chaos_weight, equal):
    """The end-to-end drill only ever sees equal weights, which comparing a run with itself would also give: here
    the two runs (processes replaced by stand-ins that finish at once) end with weights that differ, or not."""
    from pathlib import Path

    from optimus.resilience import chaos

    class FinishedRun:
        def __init__(self, command, run_dir, ranks, env, log, disk_full=None):
            self.run_dir, self.log, self.launches = Path(run_dir), Path(log), 0

        def launch(self):
            self.launches += 1

        def wait_exit(self, timeout):
            return 0

        def running(self):
            return False

        def lines(self):
            return []

    final = {"reference": {"w": torch.zeros(3)}, "chaos": {"w": torch.full((3,), chaos_weight)}}
    monkeypatch.setattr(chaos, "_Run", FinishedRun)
    monkeypatch.setattr(chaos, "_final_weights", lambda run_dir: final[Path(run_dir).name])
    config = str(Path(__file__).resolve().parents[3] / "configs" / "mula-tiny-moe.yaml")
    report = chaos.run_chaos(config, ["--train.max_steps=8"], tmp_path / "out", faults=0, ranks=1, kinds=["nan_step"])
    assert report.weights_equal is equal and report.tensors_compared == 1
    assert ("w (max abs difference 1)" in report.first_difference) is not equal


def test_a_torn_last_line_that_already_names_its_loss_is_not_read(tmp_path):
    """The trainer may be cut off mid-line after "loss" was written: that half line must not be parsed (it would
    end the harness with a JSON error) and the last whole step stays the run's last step."""
    from optimus.resilience.chaos import _Run

    run = _Run(command=[], run_dir=tmp_path, ranks=1, env={}, log=tmp_path / "log")
    whole = ['{"step": 1, "loss": 9.0}', '{"step": 2, "loss": 8.5}']
    (tmp_path / "metrics.jsonl").write_text("".join(line + "\n" for line in whole) + '{"step": 3, "loss": 8.')
    assert run.last_step() == 2 and run.lines() == whole


def test_every_fault_recovered_is_no_survival_when_the_final_weights_differ():
    """Recovering from each fault is not enough: a run that ends with weights other than the undisturbed run's
    did not survive, and the report's last line says so."""
    from optimus.resilience.chaos import ChaosReport, Fault, format_report

    faults = [Fault(kind="kill_group", at_step=2, recovered=True, recovery_s=1.0, steps_redone=1)]
    different = ChaosReport(config="c.yaml", ranks=1, max_steps=8, faults=faults, weights_equal=False,
                            tensors_compared=3, first_difference="w (max abs difference 1)")
    assert not different.survived and different.to_json()["survived"] is False
    assert format_report(different).endswith("every fault survived: NO")
    equal = ChaosReport(config="c.yaml", ranks=1, max_steps=8, faults=faults, weights_equal=True, tensors_compared=3)
    assert equal.survived


def test_steps_redone_are_those_between_the_resumed_checkpoint_and_the_fault(tmp_path):
    """A job killed after logging step 5 and relaunched from its step-3 checkpoint trains steps 4 and 5 again: the
    report says 2 steps were redone (the fault's step minus the step it resumed from)."""
    import time

    from optimus.resilience.chaos import Fault, _inject

    counter, metrics = tmp_path / "launches", tmp_path / "metrics.jsonl"
    # the relaunch rewinds metrics.jsonl to step 3 (its checkpoint) and logs step 4 anew, with another loss
    resumed = "".join(f'{{"step": {s}, "loss": 1.0}}\\n' for s in range(1, 4)) + '{"step": 4, "loss": 0.5}\\n'
    script = (f"import pathlib, time; p = pathlib.Path({str(counter)!r}); n = int(p.read_text()) if p.exists() "
              f"else 0; p.write_text(str(n + 1)); time.sleep(60) if n == 0 else "
              f"pathlib.Path({str(metrics)!r}).write_text('{resumed}')")
    run = _watched(tmp_path, 5, script)
    try:
        while not (counter.exists() and counter.read_text() == "1"):  # the first job is up, its count written whole
            time.sleep(0.01)
        fault = Fault(kind="kill_group", at_step=2)
        _inject(run, fault, random.Random(0), timeout=60.0)
        assert fault.recovered, fault.note
        assert (fault.injected_at_step, fault.steps_redone) == (5, 2)
    finally:
        if run.running():
            run.job.kill()
        run.job.wait()
