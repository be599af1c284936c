"""`optimus chaos` end to end, short (CI): 2 ranks, a tiny model, one fault of each quick kind; the run
must survive all of them and end with weights bitwise equal to the undisturbed run. The 20-fault, 4-rank
version is a soak (make test-slow)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.e2e.conftest import run_cli, tiny_config

QUICK_KINDS = "kill_rank,kill_group,bitflip_newest,disk_full,nan_step"
# make test's run: a rank killed, the newest checkpoint corrupted, a NaN step; each relaunch is seconds of start-up
# on 2 cores, so the group kill and the full disk (the same relaunch path) join them in the slow tier's run
CI_KINDS = "kill_rank,bitflip_newest,nan_step"


def _chaos(tmp_path, token_dir, faults: int, ranks: int, kinds: str | None, max_steps: int, timeout: float):
    config = tmp_path / "chaos.yaml"
    # 64 tokens per rank and step (the 50k-row LM head is most of a step's cost): --min-step-seconds keeps
    # the steps long enough to strike at a chosen one; the faults and recoveries are what is tested
    train = dict(max_steps=max_steps, ckpt_every=2, eval_every=0, keep_last_k=3, seq_len=32, micro_batch_size=2,
                 global_batch_size=2 * ranks, eval_batches=1)
    config.write_text(yaml.safe_dump(tiny_config(token_dir, train=train)))
    args = ["chaos", str(config), f"--faults={faults}", f"--ranks={ranks}", f"--out={tmp_path / 'out'}",
            "--timeout=300", "--min-step-seconds=0.3"] + ([f"--kinds={kinds}"] if kinds else [])
    done = run_cli(*args, timeout=timeout)
    report = json.loads((tmp_path / "out" / "report.json").read_text()) if (tmp_path / "out" / "report.json").exists() else None
    return done, report


@pytest.mark.parametrize("kinds, max_steps", [
    (CI_KINDS, 12),
    pytest.param(QUICK_KINDS, 16, marks=pytest.mark.slow),  # ~150 s on 2 cores
])
def test_chaos_survives_one_fault_of_each_kind_given(tmp_path, token_dir, kinds, max_steps):
    faults = len(kinds.split(","))
    done, report = _chaos(tmp_path, token_dir, faults=faults, ranks=2, kinds=kinds, max_steps=max_steps, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert sorted(f["kind"] for f in report["faults"]) == sorted(kinds.split(","))
    assert all(f["recovered"] for f in report["faults"]), report["faults"]
    assert report["weights_equal"] and report["tensors_compared"] > 0
    assert "every fault survived: yes" in done.stdout


@pytest.mark.soak
@pytest.mark.timeout(3600)  # a reference run plus 20 faults and their recoveries: ~10 minutes on 2 cores
def test_chaos_twenty_faults_four_ranks(tmp_path, token_dir):
    done, report = _chaos(tmp_path, token_dir, faults=20, ranks=4, kinds=None, max_steps=60, timeout=3600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["survived"]


def test_chaos_refuses_a_layout_that_does_not_match_the_ranks(tmp_path, token_dir):
    config = tmp_path / "chaos.yaml"
    config.write_text(yaml.safe_dump(tiny_config(token_dir, parallel=dict(dp_shard=2))))
    done = run_cli("chaos", str(config), "--ranks=4", "--faults=1", f"--out={tmp_path / 'out'}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "--ranks" in done.stderr
