"""`optimus train` on this machine's accelerator, then exact resume: benchmarks/gpu.sh runs it on a lent GPU.

    python tests/gpu/resume_check.py [CONFIG] [--steps 8] [--every 4] [OVERRIDE ...]

1. trains CONFIG (default: the default job's, mula-tiny-moe) for --steps steps, checkpointing every --every,
   through the CLI as a user runs it (the device is the one the trainer picks: the GPU where there is one);
2. copies the run and rewinds the copy to its first checkpoint (the later checkpoints and metrics removed, the
   `latest` pointer set back), as a run killed just after that checkpoint would have left it;
3. runs the same command on the copy, which resumes there, and compares the two runs' losses step by step.
Prints each run's tail and the largest loss difference; exits non-zero when a run fails, the copy did not resume
from the checkpoint, or a loss differs by more than --tolerance (relative; the default 0 asks for equal losses,
which the CPU tests get bitwise; on a GPU a kernel with atomics may not sum in the same order twice).
Not a pytest module: the CPU's own resume tests are tests/e2e/test_train_resume.py.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss; SystemExit when a step was logged twice (a run that started over instead of resuming)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r["step"] for r in records if "loss" in r]
    if len(steps) != len(set(steps)):
        raise SystemExit(f"resume_check: {run_dir} logged a step twice ({steps}): it started over, not resumed")
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def train(config: str, run_dir: Path, steps: int, every: int, overrides: list[str]) -> None:
    command = [sys.executable, "-m", "optimus.cli", "train", config, f"--run.dir={run_dir}",
               f"--train.max_steps={steps}", f"--train.ckpt_every={every}", "--train.log_every=1",
               "--train.report=false", "--train.loss_plot=false", "--no-progress", *overrides]
    print("$", " ".join(command), flush=True)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    print("\n".join((result.stdout + result.stderr).strip().splitlines()[-12:]), flush=True)
    if result.returncode != 0:
        raise SystemExit(f"resume_check: the run in {run_dir} exited {result.returncode}")


def rewind(source: Path, target: Path, step: int) -> None:
    """`target`: `source` as it stood just after committing step `step`'s checkpoint; its kept metrics records
    are marked, so that a run which started over (and rewrote them) is told from one that resumed."""
    shutil.copytree(source, target)
    for checkpoint in (target / "checkpoints").iterdir():
        if checkpoint.name.startswith("step-") and int(checkpoint.name.split("-")[1]) > step:
            shutil.rmtree(checkpoint)
    (target / "latest").write_text(str(step))
    lines = (target / "metrics.jsonl").read_text().splitlines()
    kept = [{**json.loads(line), "rewound": True} for line in lines if line.strip()]
    kept = [record for record in kept if record.get("step", 0) <= step]
    (target / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in kept))


def resumed_at(run_dir: Path, step: int) -> bool:
    """Whether the run kept the rewound records of steps 1..`step` (it resumed there) rather than rewriting them."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    early = [r for r in records if "loss" in r and r["step"] <= step]
    return bool(early) and all(r.get("rewound") for r in early)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/mula-tiny-moe.yaml")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--tolerance", type=float, default=0.0, help="largest relative loss difference allowed")
    args, overrides = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory(prefix="optimus-resume-check-") as tmp:
        straight, resumed = Path(tmp) / "straight", Path(tmp) / "resumed"
        train(args.config, straight, args.steps, args.every, overrides)
        rewind(straight, resumed, args.every)
        train(args.config, resumed, args.steps, args.every, overrides)
        expected, got = losses(straight), losses(resumed)
        if not resumed_at(resumed, args.every):
            print(f"resume_check: the second run started over instead of resuming from step {args.every}")
            return 1
    later = [s for s in sorted(expected) if s > args.every]
    if sorted(got) != sorted(expected) or not later:
        print(f"resume_check: steps logged {sorted(got)} vs {sorted(expected)} straight")
        return 1
    worst = max(abs(got[s] - expected[s]) / abs(expected[s]) for s in later)
    for s in later:
        print(f"step {s}: straight {expected[s]:.6f} resumed {got[s]:.6f}")
    verdict = "bitwise equal" if worst == 0 else f"largest relative difference {worst:.2e}"
    print(f"resume_check: steps {later[0]}-{later[-1]} after resuming at {args.every}: {verdict}")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
