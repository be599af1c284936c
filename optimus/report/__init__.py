"""`optimus report RUN`: one self-contained HTML page of a run's curves (page.py), drawn panel by panel (panels.py)."""

from optimus.report.page import REPORT_FILE, ReportError, render_report, write_report

__all__ = ["REPORT_FILE", "ReportError", "render_report", "write_report"]
