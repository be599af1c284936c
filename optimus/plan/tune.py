"""`optimus tune`: a measured search of the layout on the machine at hand, with optuna (as ORNL tuned on Frontier).

Candidates are the planner's layouts for R ranks (optimus/plan/search.py, every one through validate_layout).
Those the memory model says do not fit are recorded as pruned and never launched. Each trial picks one of the
remaining layouts (optuna's TPE over a categorical of layout keys), runs it for real with the layout's overrides
(`optimus train`, `optimus launch --nproc-per-node R train` for R > 1, or under the user's --launcher across the
allocation's nodes) for warm-up + measured steps, and scores the median measured tokens/s of the steps after the
warm-up, read from that run's metrics.jsonl. A layout suggested again is not run again. Every trial is a line of
trials.jsonl (layout, prediction, measurement, status); the best measured layout is written as a config.

The trials train where `optimus train` would: on the GPUs or XPU tiles torch sees, else on the CPU (gloo). The
prices follow them (trial_cluster): the measured `here` cluster for the CPU; for accelerators, the preset of their
kind (or the --cluster given) made the trials' job (one node of R devices, or whole nodes under a launcher), each
device with the memory it reports, so the memory model prunes by what the trials will have.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

from optimus.config import Config, ConfigError
from optimus.plan.cluster import Cluster, cluster_names, load_cluster
from optimus.plan.search import PLANNED_KEYS, Candidate, plan
from optimus.train.hardware import LocalAccelerators

GIB = 1024**3


@dataclass
class TrialRun:
    """How one real run went."""

    status: str  # "ok", or "failed: <the run's last error line>"
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    steps: list[float] | None = None


def layout_key(candidate: Candidate) -> str:
    """A short, stable name of a layout (the categorical optuna chooses among)."""
    lay = candidate.layout()
    key = (f"dp_r{lay['dp_replicate']}-dp_s{lay['dp_shard']}-tp{lay['tp']}-pp{lay['pp']}-ep{lay['ep']}-"
           f"mbs{lay['micro_batch_size']}-{lay['activation_checkpointing'].split(' ')[0]}-{lay['shard_mode']}")
    key += f"-{lay['pp_schedule']}" if lay["pp"] > 1 else ""
    return key + (f"-{lay['ep_dispatch']}" if lay["ep"] > 1 else "")  # the layouts differ in nothing else


def layout_overrides(candidate: Candidate) -> list[str]:
    """The command-line overrides that select this layout."""
    return [f"--{section}.{k}={getattr(getattr(candidate.config, section), k)}"
            for section, keys in PLANNED_KEYS.items() for k in keys]


def accelerator_preset(name: str) -> str | None:
    """The shipped preset whose device `name` (torch's name of an accelerator: "NVIDIA H100 80GB HBM3") is."""
    return next((preset for preset in cluster_names() if load_cluster(preset).device in name), None)


def trial_cluster(requested: str | None, ranks: int, found: LocalAccelerators | None,
                  launcher: bool = False) -> Cluster | None:
    """The cluster a search of `ranks`-rank trials is priced on: None where the trials train on this CPU (the caller
    measures `here`), else `requested` (--cluster: a preset or a file; None: the preset of the accelerators `found`)
    as the trials' job: one node of `ranks` devices, or whole nodes of them where a `launcher` (srun, mpiexec)
    starts the trials across the allocation; each device with the memory `found` reports (the preset's where the
    devices are on other nodes only).

    ConfigError (one line) where the prices would describe other devices than the ones the trials train on."""
    if found is None:
        if requested in (None, "here"):
            return None
        cluster = load_cluster(requested)  # an unknown name or a bad file says so first
        if not launcher:
            raise ConfigError(f"--cluster {requested} prices {cluster.device} devices, but torch sees no GPU or XPU "
                              "here, so every trial would train on the CPU: leave --cluster out to tune on this CPU, "
                              "run the search on a node of those devices, or give --launcher to start the trials "
                              "on them")
        return _job_nodes(cluster, ranks, cluster.devices_per_node, cluster.memory_gb)
    devices = f"{found.count} {found.name} ({found.device_type})"
    if requested == "here":
        raise ConfigError(f"--cluster here prices this machine's CPU, but every trial would train on its {devices}: "
                          "leave --cluster out to price those, or hide them from torch (CUDA_VISIBLE_DEVICES= or "
                          "ZE_AFFINITY_MASK=) to tune on the CPU")
    if ranks > found.count and not launcher:
        raise ConfigError(f"--ranks {ranks}, but this machine has {devices}: a trial runs on this node alone, one "
                          f"rank a device; ask for at most {found.count}, or give --launcher (srun, mpiexec) to "
                          "start the trials across nodes")
    name = requested or accelerator_preset(found.name)
    if name is None:
        raise ConfigError(f"this machine's {found.name} matches no cluster preset ({', '.join(cluster_names())}): "
                          "pass --cluster with your cluster's YAML file (`base: h100`, its device and peak_tflops)")
    return _job_nodes(load_cluster(name), ranks, found.count, found.memory_gib)


def _job_nodes(cluster: Cluster, ranks: int, per_node: int, memory_gib: float) -> Cluster:
    """`cluster` as a job of `ranks` devices of `memory_gib` each: one node of them, or whole nodes of `per_node`."""
    if ranks > per_node and ranks % per_node:
        raise ConfigError(f"--ranks {ranks} is not whole nodes of {per_node} devices: ask for a multiple of "
                          f"{per_node}")
    return replace(cluster, devices_per_node=min(ranks, per_node), memory_gb=memory_gib)


# the launchers' flags that say how many ranks they start: srun's total, or nodes x tasks a node; mpiexec's total
_MPI_TOTAL = ("-n", "-np", "--np")
_TOTAL_FLAGS = {"srun": ("-n", "--ntasks"), "mpiexec": _MPI_TOTAL, "mpirun": _MPI_TOTAL}
_SRUN_NODES, _SRUN_PER_NODE = ("-N", "--nodes"), ("--ntasks-per-node",)


def _flag_value(words: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given to any of `names` (`-n 16`, `-n16`, `--ntasks=16`, `--ntasks 16`), or None."""
    value = None
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                value = words[i + 1]
            elif word.startswith(name + "=") and name.startswith("--"):
                value = word.split("=", 1)[1]
            elif len(name) == 2 and word.startswith(name) and len(word) > 2 and word[2:].isdigit():
                value = word[2:]
    return value


def launcher_ranks(launcher: list[str]) -> int | None:
    """How many ranks `launcher` (srun, mpiexec, mpirun) starts where its flags say so, else None (a node range,
    a count from the allocation or a hostfile, another launcher)."""
    program = Path(launcher[0]).name
    total = _flag_value(launcher[1:], _TOTAL_FLAGS.get(program, ()))
    if total is not None:
        return int(total) if total.isdigit() else None
    if program == "srun":
        nodes, per_node = _flag_value(launcher[1:], _SRUN_NODES), _flag_value(launcher[1:], _SRUN_PER_NODE)
        if nodes and per_node and nodes.isdigit() and per_node.isdigit():
            return int(nodes) * int(per_node)
    return None


def trial_command(ranks: int, launcher: list[str] | None) -> list[str]:
    """What starts one trial's ranks, before `train` and its arguments: `optimus launch` (torchrun) on this node,
    or the user's launcher (`srun -N 2 --ntasks-per-node 8`, `mpiexec -n 24 --ppn 12`), which starts every rank
    itself (the trainer reads its rank from the launcher's environment: optimus/parallel/launch.py)."""
    if launcher:
        return [*launcher, sys.executable, "-m", "optimus", "train"]
    verb = ["train"] if ranks == 1 else ["launch", f"--nproc-per-node={ranks}", "train"]
    return [sys.executable, "-m", "optimus", *verb]


def run_trial(config_path: str, overrides: list[str], candidate: Candidate, ranks: int, steps: int, warmup: int,
              env: dict[str, str], timeout_s: float, launcher: list[str] | None = None,
              work_dir: Path | None = None) -> TrialRun:
    """Train `candidate` for warmup + steps steps in a subprocess; its measured throughput.

    work_dir: where the trial's run folder goes (default: the system's temporary folder); under a launcher, the
    search's --out, which the ranks on other nodes see too (their /tmp is their own)."""
    with tempfile.TemporaryDirectory(prefix="optimus-tune-", dir=work_dir) as tmp:
        run_dir = Path(tmp) / "run"
        args = [config_path, *overrides, *layout_overrides(candidate), f"--train.max_steps={warmup + steps}",
                "--train.log_every=1", f"--train.eval_every={10**6}", f"--train.ckpt_every={10**6}",
                f"--run.dir={run_dir}", "--no-progress"]
        try:
            done = subprocess.run([*trial_command(ranks, launcher), *args], capture_output=True, text=True,
                                  env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return TrialRun(f"failed: no result within {timeout_s:.0f} s")
        metrics = run_dir / "metrics.jsonl"
        if done.returncode != 0 or not metrics.is_file():
            last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            return TrialRun(f"failed: {last[:200]}")
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r and r.get("step", 0) > warmup]
    if not rates:
        return TrialRun("failed: no step after the warm-up was logged")
    tokens = candidate.config.train.global_batch_size * candidate.config.train.seq_len
    rate = statistics.median(rates)
    return TrialRun("ok", rate, tokens / rate, [tokens / r for r in rates])


def _record(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")


SEARCH_FILES = ("trials.jsonl", "best.yaml")  # what a search leaves in its --out folder


def check_tune_out(out_dir: Path, overwrite: bool = False) -> None:
    """ConfigError where `out_dir` holds an earlier search and `overwrite` is not given: a rerun with the default
    --out must not erase the last search's record."""
    folders = [name for name in SEARCH_FILES if (Path(out_dir) / name).is_dir()]
    if folders:  # --overwrite replaces files: a folder would stop the search only after its measuring and trials
        raise ConfigError(f"--out {out_dir} holds a folder named '{folders[0]}' where the search writes a file: "
                          "move it away, or choose another --out")
    held = [name for name in SEARCH_FILES if (Path(out_dir) / name).exists()]
    if held and not overwrite:
        raise ConfigError(f"--out {out_dir} already holds an earlier search ({', '.join(held)}): choose another "
                          "--out, or pass --overwrite to replace it")


def tune(config: Config, config_path: str, overrides: list[str], cluster: Cluster, ranks: int, trials: int,
         out_dir: Path, env: dict[str, str], steps: int = 2, warmup: int = 1, seed: int = 0,
         timeout_s: float = 600.0, say=print, runner=None,
         only: dict[str, frozenset[str]] | None = None, overwrite: bool = False,
         launcher: list[str] | None = None) -> tuple[Candidate | None, list[dict[str, Any]]]:
    """Run the measured search; (the best measured candidate or None, every trial's record).

    runner: what runs one trial (default run_trial, a real training subprocess), same arguments.
    only: the search held to part of the layouts (search.parse_only), as `optimus plan --only`.
    overwrite: replace an earlier search in `out_dir` (refused without it: check_tune_out).
    launcher: what starts each trial's ranks instead of `optimus launch` (trial_command); its run folders then go
    under `out_dir`.
    """
    runner = runner or partial(run_trial, launcher=launcher, work_dir=out_dir if launcher else None)
    import optuna

    candidates = plan(config, cluster, ranks, only=only)
    if not candidates:
        raise ConfigError(f"no layout of {ranks} ranks passes validate_layout for this config"
                          f"{' within --only' if only else ''}: allow more values, or check train.global_batch_size")
    fitting = {layout_key(c): c for c in candidates if c.fits}
    pruned = [c for c in candidates if not c.fits]
    if not fitting:
        raise ConfigError(f"no layout of {ranks} ranks fits this machine's memory by the planner's model "
                          f"({len(pruned)} pruned): a smaller model, batch or sequence")
    check_tune_out(out_dir, overwrite)  # before anything is written
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "best.yaml").unlink(missing_ok=True)  # the earlier search's best must not outlive its trials
    log = out_dir / "trials.jsonl"
    log.write_text("")
    records: list[dict[str, Any]] = []
    for c in pruned:  # recorded, never launched
        row = {"trial": None, "layout": c.layout(), "key": layout_key(c), "predicted_memory_gib": c.memory_bytes / GIB,
               "predicted_step_s": c.step_s, "predicted_tokens_per_s": c.tokens_per_s,
               "status": f"pruned: predicted {c.memory_bytes / GIB:.2f} GiB > {cluster.memory_gb * 0.9:.2f} GiB"}
        records.append(row)
        _record(log, row)
    say(f"{len(candidates)} layouts of {ranks} ranks; {len(pruned)} pruned by the memory model, "
        f"{len(fitting)} to choose from; {trials} trials of {warmup} + {steps} steps")
    done: dict[str, TrialRun] = {}
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    keys = sorted(fitting, key=lambda k: fitting[k].step_s)  # the planner's order: TPE starts from its best

    def objective(trial: "optuna.Trial") -> float:
        key = trial.suggest_categorical("layout", keys)
        candidate = fitting[key]
        repeat = key in done
        start = time.perf_counter()
        if not repeat:
            done[key] = runner(config_path, overrides, candidate, ranks, steps, warmup, env, timeout_s)
        result = done[key]
        row = {"trial": trial.number, "layout": candidate.layout(), "key": key,
               "predicted_memory_gib": candidate.memory_bytes / GIB, "predicted_step_s": candidate.step_s,
               "predicted_tokens_per_s": candidate.tokens_per_s, "measured_tokens_per_s": result.tokens_per_s,
               "measured_step_s": result.step_s, "measured_steps_s": result.steps,
               "status": result.status + (" (repeat: measured before)" if repeat else ""),
               "wall_s": time.perf_counter() - start}
        records.append(row)
        _record(log, row)
        say(f"trial {trial.number}: {key}: predicted {candidate.tokens_per_s:,.0f} tok/s, "
            + (f"measured {result.tokens_per_s:,.0f} tok/s" if result.status == "ok" else result.status))
        return result.tokens_per_s

    # the planner's best layout first: the search starts from the prediction
    study.enqueue_trial({"layout": keys[0]})
    study.optimize(objective, n_trials=trials)
    measured = {k: r for k, r in done.items() if r.status == "ok"}
    best = fitting[max(measured, key=lambda k: measured[k].tokens_per_s)] if measured else None
    return best, records


def format_trials(records: list[dict[str, Any]]) -> str:
    """The launched trials as a table (pruned layouts are in trials.jsonl only)."""
    launched = [r for r in records if r["trial"] is not None]
    width = max([len("layout"), *(len(r["key"]) for r in launched)])  # whole: keys differ at their ends
    lines = [f"{'trial':>5} {'layout':<{width}} {'pred tok/s':>11} {'meas tok/s':>11} {'GiB':>6}  status"]
    for r in launched:
        lines.append(f"{r['trial']:>5} {r['key']:<{width}} {r['predicted_tokens_per_s']:>11,.0f} "
                     f"{r['measured_tokens_per_s']:>11,.0f} {r['predicted_memory_gib']:>6.2f}  {r['status']}")
    return "\n".join(lines)
