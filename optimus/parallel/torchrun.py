"""`optimus launch`: torchrun in this process, so a worker's bad-input error ends the job as one line.

Under plain `torchrun ... -m optimus train ...`, a worker that refuses its input exits with code 2
and torchrun then raises ChildFailedError: a Python traceback and a failure table after our line,
and exit code 1. torchrun's own exit cannot be changed from a worker, so this wrapper runs
torchrun's launcher (torch.distributed.run) itself and, when a worker exited with code 2, prints
its one line last (read from the error file torchrun gives each worker,
which optimus.cli writes) and exits 2. Any other failure is reported as torchrun reports it.

    optimus launch --nproc-per-node=2 train configs/mula-tiny-moe.yaml --parallel.dp_shard=2
    = torchrun --nproc-per-node=2 -m optimus train configs/mula-tiny-moe.yaml --parallel.dp_shard=2
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Collection

# Set for the workers: they write their error line only to torchrun's error file and print nothing,
# since this wrapper prints it last. Read by optimus.cli.
WORKER_ERRORS_ENV = "OPTIMUS_WORKER_ERRORS"
WORKER_ERRORS_TO_LAUNCHER = "launcher"
EXIT_BAD_INPUT = 2


def split_launch_args(argv: list[str], verbs: Collection[str], alone: Collection[str] = ()
                      ) -> tuple[list[str], list[str]]:
    """(torchrun's options, the optimus command): the command starts at the first optimus verb; `alone`: the
    verbs that start their own processes or run in one (plan, tune, report, ...), named when given instead."""
    for index, arg in enumerate(argv):
        if arg in verbs:
            return argv[:index], argv[index:]
    single = next((arg for arg in argv if arg in alone), None)
    if single is not None:
        raise ValueError(f"`optimus {single}` is not started through launch: run `optimus {single} ...` on its own "
                         f"(launch starts the ranks of {', '.join(sorted(verbs))})")
    raise ValueError(f"no optimus command after the torchrun options: add one of {', '.join(sorted(verbs))}")


def _check_counts(args) -> None:
    """--nproc-per-node and --nnodes as whole numbers of at least 1 (torch asserts without a message on 0)."""
    per_node = str(args.nproc_per_node)
    if per_node.isdigit() and int(per_node) < 1 or per_node.startswith("-"):
        raise ValueError(f"--nproc-per-node {per_node}: must be at least 1 (or one of auto, cpu, gpu, xpu)")
    for bound in str(args.nnodes).split(":"):
        if not bound.isdigit() or int(bound) < 1:
            raise ValueError(f"--nnodes {args.nnodes}: give a number of nodes of at least 1 (or MIN:MAX)")


def _parse_torchrun_options(argv: list[str]):
    """torchrun's parse of `argv` (its options, `-m optimus`, the command); a mistake in the options is ValueError
    with one line (torchrun's own parser would print its 19-line usage first)."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()

    def refuse(message: str) -> None:
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            message = f"unknown launch option{'s' if ' ' in unknown else ''} {unknown}"
        raise ValueError(f"{message}: see optimus launch --help for the options it takes")

    parser.error = refuse
    return parser.parse_args(argv)


def _message_of(failure) -> str | None:
    """The one line a worker wrote to its torchrun error file (optimus.cli), or None."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message")
    return message if isinstance(message, str) and message.startswith("optimus ") else None


def run_torchrun(argv: list[str], verbs: Collection[str], alone: Collection[str] = ()) -> int:
    """Run `torchrun TORCHRUN_OPTIONS -m optimus VERB ARGS` in this process; returns the exit code (`alone`: the
    optimus verbs launch does not start, split_launch_args)."""
    from torch.distributed import DistNetworkError
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    if not any(arg in verbs for arg in argv) and any(arg in ("-h", "--help") for arg in argv):
        print("usage: optimus launch [torchrun options] VERB [its arguments]; torchrun's options:")
        parse_args(["--help"])  # prints them and exits 0
    torchrun_options, command = split_launch_args(argv, verbs, alone)
    args = _parse_torchrun_options([*torchrun_options, "-m", "optimus", *command])
    _check_counts(args)
    os.environ[WORKER_ERRORS_ENV] = WORKER_ERRORS_TO_LAUNCHER  # inherited by the workers
    # worker start/stop lines ("closing signal SIGTERM", "failed (exitcode: 2)"): the summary below says it
    process_log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    level = process_log.level
    process_log.setLevel(logging.CRITICAL)
    try:
        run(args)
        return 0
    except DistNetworkError as err:  # before any worker: the rendezvous store could not listen or connect
        first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        print(f"optimus launch: error: the rendezvous at {args.master_addr}:{args.master_port} failed ({first[:200]}): "
              "pass another --master-port (a free one), or stop what holds this one", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except (AssertionError, ValueError) as err:  # torch.distributed.elastic's own checks of the options it was given
        print(f"optimus launch: error: torchrun refused its options ({err or 'an assertion without a message'}): "
              "check --nnodes, --nproc-per-node (a number, or auto, cpu, gpu, xpu) and the rendezvous options",
              file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    except ChildFailedError as err:
        # the others were stopped by torchrun once one exited: report the lowest rank that refused its input
        refused = sorted((rank, _message_of(failure)) for rank, failure in err.failures.items()
                         if failure.exitcode == EXIT_BAD_INPUT and _message_of(failure) is not None)
        if refused:
            print(refused[0][1], file=sys.stderr, flush=True)
            return EXIT_BAD_INPUT
        rank, failure = err.get_first_failure()
        print(f"optimus launch: rank {rank} failed\n{err}", file=sys.stderr, flush=True)
        return failure.exitcode if failure.exitcode > 0 else 1
    finally:
        process_log.setLevel(level)
        os.environ.pop(WORKER_ERRORS_ENV, None)
