"""tests/gpu/layout_parity.py (the NCCL layout check benchmarks/gpu.sh runs on several GPUs) on CPU with gloo: the
script itself under torchrun, and its verdicts for a layout that departs from one process or fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed
ROOT = Path(__file__).resolve().parents[2]


def test_the_script_runs_layouts_under_torchrun_and_writes_its_verdicts(tmp_path):
    out = tmp_path / "parity.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--standalone", str(ROOT / "tests/gpu/layout_parity.py"), "--device", "cpu",
                           "--only", "zero1,fsdp-ep2", "--steps", "2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 of 2 layouts match one process" in done.stdout
    report = json.loads(out.read_text())
    assert (report["device"], report["world"]) == ("cpu", 2)
    assert [v["layout"] for v in report["layouts"]] == ["zero1", "fsdp-ep2"] and all(v["ok"] for v in report["layouts"])


def _verdicts(rank: int, world: int) -> list[dict]:
    import tests.gpu.layout_parity as script

    # bf16 compute: FSDP gathers bf16 weights where one process autocasts fp32 ones, not within fp32's parity; 3
    # experts over ep 2: refused when the ranks build it
    script.LAYOUTS[2] = {"bf16": (False, dict(dp_shard=2), dict(train={"dtype": "bf16"})),
                         "ep2-of-3-experts": (True, dict(dp_shard=2, ep=2), dict(model={"n_experts": 3}))}
    return [script.check(name, world, rank, "cpu", 2) for name in script.LAYOUTS[2]]


def test_a_layout_that_departs_or_fails_is_reported_not_hidden():
    differs, fails = run_distributed(_verdicts, 2, timeout=120)[0]
    assert not differs["ok"] and "single" in differs["error"]  # (the first departure assert_parity names)
    assert not fails["ok"] and fails["error"] and "Traceback" in fails["traceback"]


STALL_RANK_1 = '''
import os, sys, time
sys.path.insert(0, {root!r})
import tests.helpers.parity as parity
import tests.gpu.layout_parity as script

if os.environ["RANK"] == "1":  # rank 1 stops answering (a stuck device); rank 0 goes on into the first collective
    def stalled(*args, **kwargs):
        print("rank 1 stalls", file=sys.stderr, flush=True)
        time.sleep(600)
    parity.run_parallel_rank = stalled
sys.exit(script.main())
'''


@pytest.mark.slow  # a 2-rank torchrun job that must wait out its layout timeout: ~13 s on 2 cores
def test_a_stalled_rank_is_reported_as_hung_not_waited_on(tmp_path):
    wrapper, out = tmp_path / "stall_rank_1.py", tmp_path / "parity.json"
    wrapper.write_text(STALL_RANK_1.format(root=str(ROOT)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                           str(wrapper), "--device", "cpu", "--only", "fsdp,zero1", "--steps", "1",
                           "--layout-timeout", "5", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0
    assert "rank 1 stalls" in done.stderr
    assert "fsdp" in done.stdout and "HUNG after 5 s" in done.stdout, done.stdout + done.stderr
    (verdict,) = json.loads(out.read_text())["layouts"]  # the job stopped at the hung layout
    assert verdict["layout"] == "fsdp" and not verdict["ok"] and verdict["error"].startswith("hung")
