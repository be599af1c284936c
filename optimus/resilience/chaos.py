"""`optimus chaos`: inject faults into a real training job and check that it recovers with no human in the loop.

A user runs it on their own cluster before trusting it. It trains the config once undisturbed (the
reference), then again while faults strike at random steps, each followed by the recovery a scheduler
would do (torchrun's own restarts for a dead or hung rank; a relaunch of the same command, as a requeue,
when the whole job ended), and finally compares the two runs' final weights bit for bit.

Faults:
    kill_group       SIGKILL of every process of the job (a node lost, an OOM kill)       -> relaunch
    kill_rank        SIGKILL of one worker rank                                           -> torchrun restart
    kill_mid_save    SIGKILL of the job while a checkpoint is being written               -> relaunch
    sigterm          SIGTERM to every worker (preemption): checkpoint, exit 0             -> relaunch
    truncate_newest  the job stopped by SIGTERM, then its newest checkpoint truncated     -> relaunch, fall back
    bitflip_newest   ... a byte range inside the newest checkpoint's data flipped         -> relaunch, fall back
    delete_newest    ... one data file of the newest checkpoint deleted                   -> relaunch, fall back
    disk_full        the next checkpoint write fails with ENOSPC: one line, exit 2, the earlier
                     checkpoints intact            -> torchrun restart (ranks > 1) or relaunch (one process)
    nan_step         a non-finite loss at a given step (in both runs): the step is skipped by every rank
    hang_rank        one worker stopped (SIGSTOP): the others' watchdog exits 124         -> torchrun restart
Linux only (worker processes are found under /proc).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

RELAUNCH_KINDS = ("kill_group", "kill_mid_save", "sigterm", "truncate_newest", "bitflip_newest", "delete_newest")
IN_JOB_KINDS = ("kill_rank", "hang_rank")  # need torchrun (ranks >= 2)
DAMAGE_KINDS = ("truncate_newest", "bitflip_newest", "delete_newest")  # the job stopped, then its newest damaged
FAULT_KINDS = RELAUNCH_KINDS + IN_JOB_KINDS + ("disk_full", "nan_step")
NAN_STEPS_VARIABLE = "OPTIMUS_CHAOS_NAN_STEPS"  # read by cli/train.py: steps whose loss is made non-finite
MIN_STEP_VARIABLE = "OPTIMUS_CHAOS_MIN_STEP_S"  # read by cli/train.py: every step lasts at least this long
DISK_FULL_VARIABLE = "OPTIMUS_CHAOS_DISK_FULL_FILE"  # read by cli/train.py: while this file exists, a save fails (ENOSPC)


class ChaosError(RuntimeError):
    """The harness itself could not run (not a failed recovery, which the report records)."""


@dataclass
class Fault:
    kind: str
    at_step: int  # the fault strikes once training has logged this step
    injected_at_step: int | None = None
    recovered: bool = False
    recovery_s: float | None = None  # from the fault to the first step trained after it
    steps_redone: int | None = None
    note: str = ""


@dataclass
class ChaosReport:
    config: str
    ranks: int
    max_steps: int
    faults: list[Fault]
    weights_equal: bool | None = None
    tensors_compared: int = 0
    first_difference: str = ""
    reference_s: float = 0.0
    chaos_s: float = 0.0
    relaunches: int = 0

    @property
    def survived(self) -> bool:
        return all(f.recovered for f in self.faults) and bool(self.weights_equal)

    def to_json(self) -> dict:
        return {**asdict(self), "survived": self.survived}


def plan_faults(count: int, kinds: list[str], max_steps: int, rng: random.Random) -> list[Fault]:
    """`count` faults at increasing random steps; each kind is used once before any is used twice."""
    if max_steps < 2 * count + 4:
        raise ChaosError(f"{count} faults need at least {2 * count + 4} training steps: raise --train.max_steps")
    # the last fault strikes three steps before the end at the latest, so the run is still going when it does
    steps = sorted(rng.sample(range(1, max_steps - 2), count))
    order: list[str] = []
    while len(order) < count:  # every kind once (in a random order) before any kind comes again
        order += rng.sample(kinds, len(kinds))
    return [Fault(kind=kind, at_step=step) for kind, step in zip(order, steps)]


# ---------------------------------------------------------------------------------------- processes
def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _workers(job: subprocess.Popen, ranks: int) -> list[int]:
    """The training processes of the job: torchrun's children, or the job itself when it runs alone."""
    return _children(job.pid) if ranks > 1 else [job.pid]


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _kill_job(job: subprocess.Popen, ranks: int) -> None:
    """SIGKILL the whole job: torchrun starts each worker in a session of its own, so killing torchrun's
    process group alone would leave the workers training on as orphans."""
    workers = _workers(job, ranks) if ranks > 1 else []
    _signal([job.pid, *workers], signal.SIGKILL)
    job.wait()
    _wait_for(lambda: all(_is_zombie(pid) or not Path(f"/proc/{pid}").exists() for pid in workers), 60.0,
              "the killed workers to end")


def _signal(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------------------ the run
@dataclass
class _Run:
    """One run directory trained by (re)launching the same command."""

    command: list[str]
    run_dir: Path
    ranks: int
    env: dict
    log: Path
    disk_full: Path | None = None  # the trigger file of the disk_full fault
    job: subprocess.Popen | None = None
    launches: int = 0
    history: list[str] = field(default_factory=list)

    @property
    def metrics(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    def launch(self) -> None:
        self.launches += 1
        with open(self.log, "a") as log:
            log.write(f"\n=== launch {self.launches}: {' '.join(self.command)}\n")
            self.job = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                        start_new_session=True)

    def lines(self) -> list[str]:
        """The training steps' lines written whole: the trainer may be writing the last one as it is read."""
        try:
            text = self.metrics.read_text(errors="replace")
        except OSError:
            return []
        whole = text[: text.rfind("\n") + 1]  # up to the last newline: a torn tail is still being written
        return [line for line in whole.splitlines() if '"loss"' in line]

    def last_step(self) -> int:
        lines = self.lines()
        return json.loads(lines[-1])["step"] if lines else 0

    def running(self) -> bool:
        return self.job is not None and self.job.poll() is None

    def wait_exit(self, timeout: float) -> int:
        try:
            return self.job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_job(self.job, self.ranks)
            raise ChaosError(f"the job did not end within {timeout:.0f} s: see {self.log}") from None


@contextmanager
def ending_jobs_on_exit(runs: list[_Run]) -> Iterator[None]:
    """Whatever ends the harness (an error, Ctrl-C, the SIGTERM of a scheduler or `timeout`) ends the training jobs
    it started: each runs in a session of its own, so no signal to the harness reaches them, and they would train
    on as orphans. SIGTERM is turned into SystemExit(143) meanwhile, so that this cleanup runs."""
    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    in_main = threading.current_thread() is threading.main_thread()  # (only the main thread may set a handler)
    previous = signal.signal(signal.SIGTERM, terminated) if in_main else None
    try:
        yield
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
        for run in runs:
            if run.running():
                _kill_job(run.job, run.ranks)


def _train_command(config: str, overrides: list[str], ranks: int, max_restarts: int, run_dir: Path) -> list[str]:
    tail = ["-m", "optimus", "train", config, *overrides, f"--run.dir={run_dir}", "--no-progress"]
    if ranks == 1:
        return [sys.executable, *tail]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            f"--max-restarts={max_restarts}", *tail]


def _wait_for(predicate, timeout: float, what: str, poll: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise ChaosError(f"timed out after {timeout:.0f} s waiting for {what}")


def _committed(run_dir: Path) -> list[tuple[int, Path]]:
    """The run's committed checkpoints, (step, folder), oldest first."""
    return sorted((int(p.name.removeprefix("step-")), p) for p in (run_dir / "checkpoints").glob("step-*")
                  if (p / "COMMITTED").is_file() and p.name.removeprefix("step-").isdigit())


def _newest_checkpoint(run_dir: Path) -> Path | None:
    steps = _committed(run_dir)
    return steps[-1][1] if steps else None


def _damage(checkpoint: Path, kind: str, rng: random.Random) -> str:
    """Damage the checkpoint's largest data file as `kind` says; returns what was done."""
    data = sorted(checkpoint.glob("*.distcp"), key=lambda p: p.stat().st_size)
    if not data:
        raise ChaosError(f"{checkpoint} has no .distcp data files to damage")
    target = data[-1]
    size = target.stat().st_size
    if kind == "truncate_newest":
        os.truncate(target, size // 2)
        return f"truncated {target.name} to {size // 2} of {size} bytes"
    if kind == "delete_newest":
        target.unlink()
        return f"deleted {target.name}"
    start = rng.randrange(size // 4, max(size // 4 + 1, 3 * size // 4))
    length = min(4096, size - start)
    with open(target, "r+b") as handle:
        handle.seek(start)
        block = handle.read(length)
        handle.seek(start)
        handle.write(bytes(b ^ 0xFF for b in block))
    return f"flipped {length} bytes of {target.name} at offset {start}"


def _inject(run: _Run, fault: Fault, rng: random.Random, timeout: float) -> None:
    """Strike with `fault` once the run has logged its step (a damage kind: and has trained past a committed
    checkpoint, which the one its SIGTERM writes then follows: damaging the only checkpoint leaves nothing to fall
    back to, and the run rightly refuses to start); record how the run recovered."""
    def reached() -> bool:
        if not run.running():
            return True
        if fault.kind in DAMAGE_KINDS:
            committed = _committed(run.run_dir)
            if not committed or run.last_step() <= committed[-1][0]:
                return False
        return run.last_step() >= fault.at_step

    _wait_for(reached, timeout, f"step {fault.at_step}", poll=0.01)
    if not run.running():
        fault.note = f"not injected: the run had ended (exit code {run.job.returncode}) before step {fault.at_step}"
        return
    # every worker of the current attempt must be up (an in-job restart may still be starting them)
    def all_workers_up() -> list[int] | None:
        found = [pid for pid in _workers(run.job, run.ranks) if not _is_zombie(pid)]
        return found if len(found) >= run.ranks else None

    workers = _wait_for(all_workers_up, timeout, "the job's workers")
    fault.injected_at_step = run.last_step()
    struck = time.monotonic()
    if fault.kind == "kill_rank":
        victims = [rng.choice(workers)]
        _signal(victims, signal.SIGKILL)
    elif fault.kind == "hang_rank":
        victims = [rng.choice(workers)]
        _signal(victims, signal.SIGSTOP)
    elif fault.kind == "kill_group":
        _kill_job(run.job, run.ranks)
    elif fault.kind == "kill_mid_save":
        saving = lambda: any((run.run_dir / "checkpoints").glob(".tmp-step-*"))  # noqa: E731
        try:
            _wait_for(saving, timeout, "a checkpoint being written", poll=0.002)
            fault.note = "killed while a checkpoint was being written"
        except ChaosError:
            fault.note = "no save caught in progress: killed at the next poll"
        _kill_job(run.job, run.ranks)
        struck = time.monotonic()
    elif fault.kind == "disk_full":
        run.disk_full.touch()  # the job's next checkpoint write fails as on a full disk, once
        _wait_for(lambda: not run.disk_full.exists() or not run.running(), timeout, "a checkpoint write")
        if run.disk_full.exists():
            run.disk_full.unlink()
            fault.note = "not injected: no checkpoint was written before the run ended"
            return
        struck = time.monotonic()
        fault.note = "a checkpoint write failed with ENOSPC"
    else:  # sigterm and the damage kinds: a preemption first, as Slurm or PBS would send it
        _signal(workers, signal.SIGTERM)
    if fault.kind in RELAUNCH_KINDS or (fault.kind == "disk_full" and run.ranks == 1):
        code = run.wait_exit(timeout)
        if fault.kind == "disk_full":
            fault.note += f"; the run stopped with exit code {code} (2 expected) and was relaunched"
        before = run.lines()  # the old job is gone: what it wrote last is final
        fault.injected_at_step = json.loads(before[-1])["step"] if before else 0
        if fault.kind in DAMAGE_KINDS:
            newest = _newest_checkpoint(run.run_dir)
            if newest is None:
                raise ChaosError("no committed checkpoint to damage: lower --train.ckpt_every")
            fault.note = f"{newest.name}: {_damage(newest, fault.kind, rng)}"
        run.launch()
    else:
        # torchrun restarts the group: every worker of the struck attempt is ended before the new one starts
        _wait_for(lambda: not any(Path(f"/proc/{pid}").exists() and not _is_zombie(pid) for pid in workers)
                  or not run.running(), timeout, "the struck attempt's workers to end")
        before = run.lines()
        fault.injected_at_step = json.loads(before[-1])["step"] if before else 0

    def trained_again() -> list[str] | None:
        lines = run.lines()
        # a restarted run first rewinds metrics.jsonl to its checkpoint, then appends: a line that is not the
        # old file's is a step trained after the fault (every line carries its own tokens/s)
        return lines if lines and lines != before[:len(lines)] else None

    def trained_again_or_done() -> list[str] | None:
        lines = trained_again()
        if lines is None and not run.running():
            if run.job.returncode == 0:
                return run.lines()  # the fault came after the last step: the restarted job found nothing to redo
            raise ChaosError(f"the run ended with exit code {run.job.returncode} instead of training again: see "
                             f"{run.log}")
        return lines

    try:
        lines = _wait_for(trained_again_or_done, timeout, f"training to resume after {fault.kind}")
    except ChaosError as err:
        fault.note = (fault.note + "; " if fault.note else "") + str(err)
        return
    fault.recovery_s = time.monotonic() - struck
    first_new = next((i for i, line in enumerate(lines) if i >= len(before) or line != before[i]), None)
    resumed_from = json.loads(lines[first_new])["step"] - 1 if first_new is not None else fault.injected_at_step
    fault.steps_redone = max(0, fault.injected_at_step - resumed_from)
    fault.recovered = True
    _progress(f"fault {fault.kind} at step {fault.injected_at_step}: training again after {fault.recovery_s:.1f} s, "
              f"{fault.steps_redone} step(s) redone")


def _progress(line: str) -> None:
    print(f"chaos: {line}", file=sys.stderr, flush=True)


def _final_weights(run_dir: Path) -> dict:
    from optimus.checkpoint.manager import CheckpointManager
    from optimus.config import load_config
    from optimus.models.transformer import build_model
    from optimus.train.state import ModelState

    config = load_config(run_dir / "config.yaml")
    manager = CheckpointManager(run_dir)
    step = manager.latest()
    if step != config.train.max_steps:
        raise ChaosError(f"{run_dir} ended at checkpoint {step}, not at step {config.train.max_steps}")
    model = build_model(config.model, device="cpu")
    manager.load(step, {"model": ModelState(model)})
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def compare_weights(reference: dict, candidate: dict) -> tuple[bool, int, str]:
    """(bitwise equal, tensors compared, the first tensor that differs)."""
    import torch

    if set(reference) != set(candidate):
        return False, 0, f"different tensor names: {sorted(set(reference) ^ set(candidate))[:3]}"
    for name in sorted(reference):
        if not torch.equal(reference[name], candidate[name]):
            diff = (reference[name].float() - candidate[name].float()).abs().max().item()
            return False, len(reference), f"{name} (max abs difference {diff:.3g})"
    return True, len(reference), ""


# what run_chaos writes under --out, and so all it may remove there before a new run (nothing else is its to delete)
CHAOS_OUTPUTS = ("reference", "chaos", "reference.log", "chaos.log", "report.json", "disk-full.trigger")


def _clear_earlier_report(out_dir: Path) -> None:
    """Remove an earlier chaos run's outputs from `out_dir`; any other file there stays."""
    for name in CHAOS_OUTPUTS:
        path = out_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def run_chaos(config: str, overrides: list[str], out_dir: Path, faults: int, ranks: int, kinds: list[str],
              seed: int = 0, hang_timeout_s: float = 20.0, timeout: float = 600.0,
              min_step_s: float = 0.0, env: Mapping[str, str] | None = None) -> ChaosReport:
    """The reference run, the run under faults, and the comparison (see the module docstring).
    `env` is the environment the training jobs start from (the CLI passes its own; default: a bare one)."""
    from optimus.config import load_config

    if ranks < 2 and any(kind in IN_JOB_KINDS for kind in kinds):
        raise ChaosError(f"{', '.join(k for k in kinds if k in IN_JOB_KINDS)} need --ranks 2 or more (torchrun)")
    unknown = [kind for kind in kinds if kind not in FAULT_KINDS]
    if unknown:
        raise ChaosError(f"unknown fault kind {unknown[0]!r}: choose from {', '.join(FAULT_KINDS)}")
    loaded = load_config(config, overrides)
    max_steps, p = loaded.train.max_steps, loaded.parallel
    layout_ranks = p.layout_ranks
    if layout_ranks == 1 and ranks > 1:
        overrides = [*overrides, f"--parallel.dp_shard={ranks}"]  # plain data parallelism over the ranks asked
    elif layout_ranks != ranks:
        raise ChaosError(f"the config's layout needs {layout_ranks} ranks but --ranks is {ranks}: make them agree")
    from optimus.parallel.validate import validate_layout

    validate_layout(load_config(config, overrides), ranks)  # what the trainer would refuse, refused here in one line
    rng = random.Random(seed)
    plan = plan_faults(faults, kinds, max_steps, rng)
    nan_steps = ",".join(str(f.at_step + 1) for f in plan if f.kind == "nan_step")
    overrides = [*overrides, f"--resilience.hang_timeout_s={hang_timeout_s if 'hang_rank' in kinds else 0}"]
    env = dict(env or {})
    env.update({NAN_STEPS_VARIABLE: nan_steps, MIN_STEP_VARIABLE: str(min_step_s),
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    _clear_earlier_report(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    restarts = sum(f.kind in IN_JOB_KINDS for f in plan) + 1
    report = ChaosReport(config=config, ranks=ranks, max_steps=max_steps, faults=plan)

    reference = _Run(_train_command(config, overrides, ranks, 0, out_dir / "reference"), out_dir / "reference",
                     ranks, env, out_dir / "reference.log")
    trigger = out_dir / "disk-full.trigger"
    chaos = _Run(_train_command(config, overrides, ranks, restarts, out_dir / "chaos"), out_dir / "chaos", ranks,
                 {**env, DISK_FULL_VARIABLE: str(trigger)}, out_dir / "chaos.log", disk_full=trigger)
    with ending_jobs_on_exit([reference, chaos]):
        started = time.monotonic()
        _progress(f"reference run ({max_steps} steps, {ranks} rank(s)) in {reference.run_dir}")
        reference.launch()
        if reference.wait_exit(timeout) != 0:
            raise ChaosError(f"the undisturbed reference run failed: see {reference.log}")
        report.reference_s = time.monotonic() - started

        started = time.monotonic()
        _progress(f"run under {len(plan)} faults in {chaos.run_dir}")
        chaos.launch()
        for fault in plan:
            if fault.kind == "nan_step":
                continue  # injected by the run itself at its step; checked below
            _inject(chaos, fault, rng, timeout)
        if chaos.wait_exit(timeout) != 0:
            raise ChaosError(f"the run under faults did not finish cleanly: see {chaos.log}")
    report.chaos_s = time.monotonic() - started
    report.relaunches = chaos.launches - 1
    records = [json.loads(line) for line in chaos.lines()]
    for fault in plan:
        if fault.kind == "nan_step":
            step = fault.at_step + 1
            skipped = [r for r in records if r["step"] == step and r.get("skip_reason") == "non-finite"]
            fault.injected_at_step, fault.recovered, fault.steps_redone = step, bool(skipped), 0
            fault.note = "step skipped on every rank" if skipped else "the step was not skipped"
    report.weights_equal, report.tensors_compared, report.first_difference = compare_weights(
        _final_weights(reference.run_dir), _final_weights(chaos.run_dir))
    (out_dir / "report.json").write_text(json.dumps(report.to_json(), indent=1))
    return report


def format_report(report: ChaosReport) -> str:
    """A plain-text table: one line per fault, then the verdict."""
    lines = [f"chaos: {report.config}, {report.ranks} rank(s), {report.max_steps} steps, {len(report.faults)} faults",
             f"{'#':>3} {'fault':<16} {'step':>5} {'recovered':>9} {'recovery s':>10} {'redone':>6}  note"]
    for i, f in enumerate(report.faults, 1):
        recovery = f"{f.recovery_s:.1f}" if f.recovery_s is not None else "-"
        redone = str(f.steps_redone) if f.steps_redone is not None else "-"
        lines.append(f"{i:>3} {f.kind:<16} {f.injected_at_step or f.at_step:>5} {'yes' if f.recovered else 'NO':>9} "
                     f"{recovery:>10} {redone:>6}  {f.note}")
    verdict = "bitwise equal" if report.weights_equal else f"DIFFERENT: {report.first_difference}"
    lines.append(f"final weights vs the undisturbed run: {verdict} ({report.tensors_compared} tensors)")
    lines.append(f"reference {report.reference_s:.0f} s, under faults {report.chaos_s:.0f} s, "
                 f"{report.relaunches} relaunches; every fault survived: {'yes' if report.survived else 'NO'}")
    return "\n".join(lines)
