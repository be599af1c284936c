"""report.html at the end of every run (rank 0): the run report of optimus/report."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

from optimus.train.callbacks.base import Callback


class RunReport(Callback):
    """Writes RUN/report.html when training ends, also after a failure (the report shows what led to it).

    `written_unless()`: True skips it (a preempted run must leave within its grace period). Drawing the
    report never fails the run: a problem is one warning line on stderr.
    """

    def __init__(self, run_dir: Path, written_unless: Callable[[], bool] = lambda: False):
        self.run_dir = Path(run_dir)
        self.written_unless = written_unless

    def on_train_end(self, step: int) -> None:
        if self.written_unless():
            return
        from optimus.report import ReportError, write_report

        try:
            write_report(self.run_dir)
        except ReportError:
            return  # nothing logged yet: no report to draw
        except Exception as err:  # a plotting problem must not turn a finished run into a failed one
            print(f"warning: the run report could not be written ({type(err).__name__}: {err}); "
                  f"try again with optimus report {self.run_dir}", file=sys.stderr, flush=True)
