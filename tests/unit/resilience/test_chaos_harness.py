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
