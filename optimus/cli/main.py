"""The `optimus` command's argument parser and entry point: one function per verb, bad input as one line.

Bad input (config, data, checkpoint, flags), and a run that cannot go on as configured (too many skipped
steps in a row), end with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path

from optimus.cli.errors import (EXIT_BAD_INPUT, OneLineErrorParser, UsageError, stop_writing_to_a_closed_pipe,
                                usage_error_line, user_errors)
from optimus.cli.info import cmd_info
from optimus.cli.plan import cmd_plan, cmd_tune, token_count
from optimus.cli.runs import cmd_eval, cmd_export, cmd_generate, cmd_import, cmd_report, cmd_verify
from optimus.cli.train import cmd_chaos, cmd_tokenize, cmd_train


ONLY_HELP = ("search only layouts whose KEY (a --json layout key: dp_replicate, dp_shard, tp, pp, ep, "
             "micro_batch_size, grad_accum, activation_checkpointing, shard_mode, pp_schedule, ep_dispatch) is one "
             "of the values; repeat for other keys (--only tp=1 --only shard_mode=zero1,zero2: what a stack without TP runs). "
             "pp_schedule applies where pp > 1, ep_dispatch where ep > 1")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="optimus", description="Pretrain dense and MoE language models.")
    verbs = parser.add_subparsers(dest="verb", required=True)

    train = verbs.add_parser("train", help="train (or resume) a run from a YAML config; --section.key=value overrides")
    train.add_argument("config", help="YAML config, e.g. configs/mula-tiny-moe.yaml")
    train.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    train.add_argument("--world-size", type=int, default=None,
                       help="with --dry-run: also apply the layout for a job of N ranks (meta device, fake process "
                            "group) and print each rank's memory")
    train.add_argument("--device-memory-gb", type=float, default=64.0,
                       help="with --dry-run --world-size: device memory to compare against (default 64)")
    train.add_argument("--no-progress", action="store_true", help="no live progress bar")
    train.set_defaults(func=cmd_train, takes_overrides=True)

    chaos = verbs.add_parser("chaos", help="train a config undisturbed and again under injected faults; compare")
    chaos.add_argument("config", help="YAML config (overrides --section.key=value apply to both runs)")
    chaos.add_argument("--faults", type=int, default=10, help="how many faults to inject (default 10)")
    chaos.add_argument("--ranks", type=int, default=2, help="processes per run, under torchrun when > 1 (default 2)")
    chaos.add_argument("--kinds", help="comma list of fault kinds (default: all that the rank count allows)")
    chaos.add_argument("--seed", type=int, default=0, help="draws the faults' kinds, steps and victims")
    chaos.add_argument("--hang-timeout", type=float, default=20.0, help="watchdog timeout for hang_rank (s)")
    chaos.add_argument("--timeout", type=float, default=600.0, help="longest wait for any one stage (s)")
    chaos.add_argument("--out", help="output folder (default runs/chaos-CONFIG)")
    chaos.add_argument("--min-step-seconds", type=float, default=0.0,
                       help="make every step last at least this long (tiny test models), in both runs")
    chaos.set_defaults(func=cmd_chaos, takes_overrides=True)

    tokenize = verbs.add_parser("tokenize", help="turn txt/jsonl[.gz|.zst]/parquet into token memmaps")
    from optimus.data.tokenize import add_tokenize_arguments

    add_tokenize_arguments(tokenize)
    tokenize.set_defaults(func=cmd_tokenize)

    ev = verbs.add_parser("eval", help="held-out loss, perplexity and bits per byte of a run")
    ev.add_argument("run")
    ev.add_argument("--data", help="tokenized directory or .bin file (default: the run's own held-out split)")
    ev.add_argument("--batches", type=int, default=16)
    ev.add_argument("--batch-size", type=int, default=4)
    ev.add_argument("--seq-len", type=int, default=None)
    ev.add_argument("--tasks", help="downstream tasks instead of held-out loss, comma-separated (e.g. arc_easy,"
                                    "hellaswag): log-likelihood ranking, written to RUN/eval_tasks.json")
    ev.add_argument("--limit", type=int, default=None, help="with --tasks: the first N questions of each task")
    ev.set_defaults(func=cmd_eval)

    gen = verbs.add_parser("generate", help="continue a prompt with a trained run")
    gen.add_argument("run")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed, 0 <= seed < 2**63")
    gen.set_defaults(func=cmd_generate)

    export = verbs.add_parser("export", help="write a run's weights in another format")
    export.add_argument("run")
    export.add_argument("--format", choices=["hf"], required=True)
    export.add_argument("--out", required=True)
    export.add_argument("--dense-format", choices=["auto", "olmo2", "llama"], default="auto",
                        help="dense models: OLMo-2 (post-norm, QK-norm) or Llama (pre-norm, no QK-norm)")
    export.add_argument("--overwrite", action="store_true", help="replace the model --out already holds")
    export.set_defaults(func=cmd_export)

    imp = verbs.add_parser("import", help="turn a Hugging Face OLMoE / OLMo-2 / Llama directory into a run")
    imp.add_argument("hf_dir")
    imp.add_argument("--out", required=True)
    imp.set_defaults(func=cmd_import)

    report = verbs.add_parser("report", help="one HTML page of a run's curves (loss, throughput, MFU, expert load, "
                                             "memory, checkpoints...), written at the end of every run too")
    report.add_argument("run")
    report.add_argument("--out", default=None, help="the HTML file to write (default RUN/report.html)")
    report.add_argument("--overwrite", action="store_true",
                        help="replace the file --out names (RUN/report.html, the run's own, is always rewritten)")
    report.set_defaults(func=cmd_report)

    verify = verbs.add_parser("verify", help="check every checkpoint of a run (sizes, hashes, index); exit 2 if any is bad")
    verify.add_argument("run")
    verify.set_defaults(func=cmd_verify)

    info = verbs.add_parser("info", help="parameters and FLOPs per token of the presets (or of a config)")
    info.add_argument("target", nargs="?", help="a preset name or a config file")
    info.add_argument("--seq-len", type=int, default=4096)
    info.set_defaults(func=cmd_info, takes_overrides=True)

    plan = verbs.add_parser("plan", help="predict memory, step time, MFU and energy of every valid layout on a cluster; "
                                         "rank them")
    plan.add_argument("config", help="YAML config (any model: a preset via --model.preset=NAME, or a config file)")
    plan.add_argument("--cluster", required=True,
                      help="cluster preset: aurora, frontier, lumi, h100, h200, a100, or here (this machine, "
                           "measured); or the path of your cluster's YAML file (a preset's keys; `base: h100` "
                           "starts from one)")
    plan.add_argument("--calibrate", action="store_true",
                      help="with --cluster here: time matmuls, memory-bound ops, operator overhead and gloo "
                           "collectives at this config's shapes, store the fit for later runs, print it; with a GPU "
                           "cluster, on a node of its devices: time the op classes and the node's collectives, "
                           "write them as a cluster file (--calibrated-cluster) and plan on it")
    plan.add_argument("--calibrated-cluster", default=None, metavar="FILE",
                      help="with --calibrate on a GPU node: the cluster file to write (default: "
                           "CLUSTER-calibrated.yaml here)")
    plan.add_argument("--devices", type=int, required=True, help="devices (GPU tiles / GCDs) of the job: whole nodes")
    plan.add_argument("--tokens", type=token_count, default=None,
                      help="token budget (100e9, 100B, 2.5T): also print days, MWh and tCO2e")
    plan.add_argument("--top", type=int, default=10, help="layouts to print (default 10)")
    plan.add_argument("--json", default=None, help="write every layout, ranked, to this JSON file")
    plan.add_argument("--write-config", default=None, help="write the best fitting layout as a config file")
    plan.add_argument("--overwrite", action="store_true",
                      help="replace the files --json, --write-config and --calibrated-cluster name")
    plan.add_argument("--efficiency", type=float, default=None,
                      help="fraction of peak FLOP/s every compute op class reaches (default: the cluster preset's "
                           "efficiency block)")
    plan.add_argument("--moe-imbalance", type=float, default=1.0, metavar="X",
                      help="MoE: plan for the busiest expert-holding rank receiving X times its balanced share of "
                           "token copies (default 1: balanced routing; a random router at initialization gave "
                           "1.1-1.7x on a tiny MoE): its activations and its expert GEMMs' time")
    plan.add_argument("--moe-routing", default=None, metavar="RUN",
                      help="MoE: plan at the routing the run RUN logged (a run folder or its metrics.jsonl, of the "
                           "same model shape), each layout at its own split of the experts over ep x tp ranks")
    plan.add_argument("--scaling-from", type=int, default=None, metavar="M",
                      help="also plan M devices (fewer, whole nodes) and print each layout's scaling efficiency "
                           "against that smaller run's best: tokens/s per device over its (JSON: scaling_efficiency)")
    plan.add_argument("--scaling", choices=("strong", "weak"), default=None,
                      help="with --scaling-from: strong (default) keeps the global batch on the smaller run, weak "
                           "cuts it by M / devices (the same sequences per device)")
    plan.add_argument("--only", action="append", metavar="KEY=V1[,V2...]", help=ONLY_HELP)
    plan.set_defaults(func=cmd_plan, takes_overrides=True)

    tune_ = verbs.add_parser("tune", help="measured layout search on this machine (its GPUs, else its CPU): short "
                                          "real runs of the planner's feasible layouts, chosen by optuna; every trial "
                                          "recorded, the best written as a config")
    tune_.add_argument("config", help="YAML config (overrides as for train)")
    tune_.add_argument("--trials", type=int, required=True, help="layouts to run")
    tune_.add_argument("--ranks", type=int, default=1,
                       help="processes per trial, one per GPU or XPU tile where torch sees them, else gloo ranks on "
                            "the CPU (default 1)")
    tune_.add_argument("--cluster", default=None,
                       help="the preset or cluster file the trials are priced and pruned on (default: the preset of "
                            "this machine's accelerators, made one node of --ranks of them with their own memory; "
                            "here, measured, on a CPU)")
    tune_.add_argument("--launcher", default=None, metavar="COMMAND",
                       help="what starts each trial's --ranks ranks across the allocation's nodes, before `python -m "
                            "optimus train ...`: 'srun -N 2 --ntasks-per-node 8', 'mpiexec -n 24 --ppn 12' (default: "
                            "optimus launch on this node)")
    tune_.add_argument("--trial-timeout", type=float, default=600.0, metavar="S",
                       help="seconds a trial may take, start-up included, before it is stopped and recorded as "
                            "failed (default 600)")
    tune_.add_argument("--steps", type=int, default=2, help="measured steps per trial, after the warm-up (default 2)")
    tune_.add_argument("--warmup", type=int, default=1, help="steps not measured (default 1)")
    tune_.add_argument("--only", action="append", metavar="KEY=V1[,V2...]", help=ONLY_HELP)
    tune_.add_argument("--seed", type=int, default=0, help="optuna sampler seed")
    tune_.add_argument("--out", default="runs/tune", help="where trials.jsonl and best.yaml go (default runs/tune)")
    tune_.add_argument("--overwrite", action="store_true",
                       help="replace the earlier search --out holds (trials.jsonl, best.yaml)")
    tune_.set_defaults(func=cmd_tune, takes_overrides=True)

    # listed here for `optimus --help` only: main() hands `bench` and all after it to cli/bench.py before argparse
    verbs.add_parser("bench", help="the benchmarks/ scripts of a source checkout: list them, or run one by name with "
                                   "its own arguments (each compares ours with its reference in the same run)")
    verbs.add_parser("launch", help="torchrun's options, then an optimus command: runs the ranks under torchrun "
                                    "and ends a bad-input error with one line and exit code 2",
                     usage="optimus launch [torchrun options] VERB ...")
    return parser


_VERBS = ("train", "tokenize", "eval", "generate", "export", "import", "info")
# verbs that run in one process or start their own (tune launches its trials; chaos its runs): not under launch
_ALONE_VERBS = ("chaos", "report", "verify", "plan", "tune", "launch", "bench")


def _report_user_error(line: str) -> None:
    """Bad input ends the job with `line` once: on rank 0 only (every rank usually meets the same error).

    Under torchrun the line also goes to the worker's error file, so torchrun's failure summary names
    it and `optimus launch` prints it last. Other ranks wait a moment first (_quiet_rank_delay): torchrun
    stops every worker as soon as one exits, and rank 0 should have said why by then (a rank that alone
    meets the error still records it after the wait).
    """
    import json
    import os

    from optimus.parallel.launch import LaunchError, detect_launch_env
    from optimus.parallel.torchrun import WORKER_ERRORS_ENV, WORKER_ERRORS_TO_LAUNCHER

    try:
        rank = detect_launch_env().rank
    except (LaunchError, ValueError):
        rank = 0
    if rank != 0:  # a rank stopped meanwhile by torchrun leaves no record: rank 0's is the root cause
        time.sleep(_quiet_rank_delay())
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        try:
            Path(error_file).write_text(json.dumps({"message": record}))
        except OSError:
            pass  # the line is still printed below
    if rank == 0 and os.environ.get(WORKER_ERRORS_ENV) != WORKER_ERRORS_TO_LAUNCHER:
        print(line, file=sys.stderr, flush=True)


_QUIET_RANK_DELAY_S = 3.0
_QUIET_RANK_MAX_DELAY_S = 60.0
_STARTED = time.monotonic()  # about when this process started (`optimus` imports this module first)


def _quiet_rank_delay() -> float:
    """How long a non-zero rank waits before it records its error, so that rank 0 has met the same error by then.

    Once the ranks have met (a process group), they run in step: _QUIET_RANK_DELAY_S. Before that (a bad layout or
    config, found by every rank on its own after the start-up's imports) rank 0 may be seconds behind: two ranks
    of one torchrun on a busy 2-core host reached the same error 5 s apart, 9 s after they started. They started
    together and do the same work, so this rank waits twice as long as it took to get here (at most
    _QUIET_RANK_MAX_DELAY_S): by then rank 0 has met the error even at a third of its pace."""
    distributed = sys.modules.get("torch.distributed")  # not imported: no process group yet
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        return _QUIET_RANK_DELAY_S
    return min(_QUIET_RANK_MAX_DELAY_S, max(_QUIET_RANK_DELAY_S, 2 * (time.monotonic() - _STARTED)))


def check_omp_num_threads(environ: MutableMapping[str, str] = os.environ) -> None:
    """OMP_NUM_THREADS as OpenMP takes it, before torch loads libgomp: a positive integer (or a comma list of them,
    one per nesting level), or UsageError; libgomp itself only warns and runs on every core. An empty value is
    removed, as unset: libgomp would warn about it too, and torchrun gives several ranks one thread each only
    where the variable is unset."""
    value = environ.get("OMP_NUM_THREADS")
    if value is None:
        return
    if not value.strip():
        del environ["OMP_NUM_THREADS"]
        return
    if not all(re.fullmatch(r"\s*\+?[0-9]+\s*", level) and int(level) > 0 for level in value.split(",")):
        del environ["OMP_NUM_THREADS"]  # torch, imported to report this, must not have libgomp warn about it too
        raise UsageError(f"OMP_NUM_THREADS={value!r} is not a positive number of threads: unset it, or set it to a "
                         "positive integer (the threads each process uses, e.g. OMP_NUM_THREADS=4)")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `optimus` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # torchrun's options pass through untouched: no argparse here
        from optimus.parallel.torchrun import run_torchrun

        try:
            check_omp_num_threads()
            return run_torchrun(argv[1:], _VERBS, _ALONE_VERBS)
        except ValueError as err:
            print(f"optimus launch: error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if argv[:1] == ["bench"]:  # the script's own flags pass through untouched, --help included
        from optimus.cli.bench import run_bench

        return run_bench(argv[1:])
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_overrides", False):
        print(usage_error_line(f"optimus {args.verb}", f"unrecognized arguments: {' '.join(extra)}"), file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        check_omp_num_threads()  # before any verb imports torch
        code = args.func(args, extra)
    except user_errors() as err:
        _report_user_error(f"optimus {args.verb}: error: {err}")
        return EXIT_BAD_INPUT
    except PermissionError as err:  # a path the command was given, or its run directory, this user may not use
        where = err.filename or err
        _report_user_error(f"optimus {args.verb}: error: permission denied on {where}: give this user read and write "
                           "access to it, or choose another path")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return stop_writing_to_a_closed_pipe()
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):  # a write that names no path (a flush, a close): still the disk
            _report_user_error(f"optimus {args.verb}: error: {err.strerror or 'no space left'} where it writes: free "
                               "space there (or write elsewhere), then rerun")
            return EXIT_BAD_INPUT
        if err.filename is None:  # not about a path the user gave (a socket, a library's own file): a real fault
            raise
        # a path the system refused (missing, read-only filesystem, disk full, a /proc or /sys file): one line
        _report_user_error(f"optimus {args.verb}: error: {err.strerror or type(err).__name__} on {err.filename}: "
                           "check that path (it must exist and be writable where the command writes), or choose "
                           "another")
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"optimus {args.verb}: interrupted", file=sys.stderr)
        return 130
    from optimus.parallel.launch import leave_distributed

    return leave_distributed(code)

