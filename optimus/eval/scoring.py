"""Log-likelihood ranking: a question is answered by the choice whose continuation the model finds likeliest.

For every (context, continuation) we sum the log-probabilities of the continuation's tokens given
everything before them. Two accuracies, as OLMo reports them:
  acc       the choice with the largest summed log-likelihood;
  acc_norm  the choice with the largest log-likelihood per character of the continuation text, its
            leading space not counted (OLMo's "len_norm"; lm-evaluation-harness's acc_norm divides
            by the length of the choice text, which is the same string without that space).
Context and continuation are tokenized separately and concatenated (as OLMo does); a pair longer
than the model's window keeps its tail (the continuation and the nearest context).

Requests are sorted by length and scored `batch_size` at a time, right-padded: the model is causal,
so padding after a sequence cannot change the logits of the tokens before it. With a process group
each rank scores an equal-sized strided slice of all requests (equal, so FSDP's and EP's collectives
line up: every rank runs the same number of forwards) and the per-request scores are summed over
the group, after which every rank holds every score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from optimus.eval.tasks import Question, load_task
from optimus.train.step import autocast_context


@dataclass(frozen=True)
class TaskScore:
    acc: float
    acc_norm: float  # per-character length-normalised (leading space not counted)
    questions: int

    def as_record(self) -> dict[str, float | int]:
        """The JSON form written to eval_tasks.json and metrics.jsonl."""
        return {"acc": self.acc, "acc_norm": self.acc_norm, "n": self.questions}


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


@torch.no_grad()
def continuation_logliks(
    model: nn.Module,
    requests: list[tuple[list[int], list[int]]],
    device: torch.device,
    *,
    max_len: int,
    batch_size: int = 8,
    dtype: str = "fp32",
    pad_multiple: int = 1,
) -> list[float]:
    """Summed log-probability of each continuation's tokens given its context tokens, in request order.

    Each batch is right-padded to a multiple of `pad_multiple` tokens (sequence parallelism splits the
    sequence over the TP ranks, so it must divide evenly)."""
    rows = []  # (input ids, index of the first continuation logit, continuation ids)
    for context, continuation in requests:
        continuation = continuation[-max_len:]
        tokens = (context + continuation)[-(max_len + 1):]
        inputs = tokens[:-1]
        rows.append((inputs, len(inputs) - len(continuation), continuation))
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    scores = [0.0] * len(rows)
    was_training = model.training
    model.eval()
    try:
        for first in range(0, len(order), batch_size):
            batch = order[first:first + batch_size]
            width = -(-len(rows[batch[0]][0]) // pad_multiple) * pad_multiple
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            for b, i in enumerate(batch):
                ids[b, :len(rows[i][0])] = torch.tensor(rows[i][0])
            with autocast_context(device, dtype):
                logits = model(ids.to(device)).logits
            for b, i in enumerate(batch):
                _, start, continuation = rows[i]
                logprobs = F.log_softmax(logits[b, start:start + len(continuation)].float(), dim=-1)
                target = torch.tensor(continuation, device=logprobs.device).unsqueeze(1)
                scores[i] = logprobs.gather(1, target).sum().item()
    finally:
        model.train(was_training)
    return scores


def _rank_slice(n: int, group) -> tuple[list[int], int]:
    """This rank's request indices (strided, padded with index 0 so every rank has as many) and n padded."""
    if group is None:
        return list(range(n)), n
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    padded = -(-n // world) * world
    return [i if i < n else 0 for i in range(rank, padded, world)], padded


def score_questions(
    model: nn.Module,
    tokenizer,
    tasks: dict[str, list[Question]],
    device: torch.device,
    *,
    max_len: int,
    batch_size: int = 8,
    dtype: str = "fp32",
    group=None,
    pad_multiple: int = 1,
) -> dict[str, TaskScore]:
    """Accuracy and per-character accuracy of each task's questions (data-parallel over `group` if given)."""
    flat = []  # (task, question number, choice, context, continuation)
    for name, questions in tasks.items():
        for q, question in enumerate(questions):
            for c, (context, continuation) in enumerate(zip(question.contexts, question.continuations)):
                flat.append((name, q, c, context, continuation))
    mine, padded = _rank_slice(len(flat), group)
    requests = [(_encode(tokenizer, flat[i][3]), _encode(tokenizer, flat[i][4])) for i in mine]
    logliks = continuation_logliks(model, requests, device, max_len=max_len, batch_size=batch_size, dtype=dtype,
                                   pad_multiple=pad_multiple)
    if group is not None:
        # each slot is written by exactly one rank (padding slots hold a copy of request 0 and are dropped)
        gathered = torch.zeros(padded, dtype=torch.float64, device=device)
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        gathered[torch.arange(rank, padded, world, device=device)] = torch.tensor(
            logliks, dtype=torch.float64, device=device)
        dist.all_reduce(gathered, group=group)
        logliks = gathered[:len(flat)].tolist()
    per_question: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    for (name, q, c, _, continuation), loglik in zip(flat, logliks):
        characters = len(continuation) - continuation.startswith(" ")
        per_question.setdefault((name, q), {})[c] = (loglik, loglik / max(characters, 1))
    results = {}
    for name, questions in tasks.items():
        right = right_norm = 0
        for q, question in enumerate(questions):
            choices = per_question[(name, q)]
            # ties go to the lowest index, as argmax does
            right += max(choices, key=lambda c: (choices[c][0], -c)) == question.gold
            right_norm += max(choices, key=lambda c: (choices[c][1], -c)) == question.gold
        n = max(len(questions), 1)
        results[name] = TaskScore(acc=right / n, acc_norm=right_norm / n, questions=len(questions))
    return results


def evaluate_tasks(
    model: nn.Module,
    tokenizer,
    names: list[str],
    device: torch.device,
    *,
    max_len: int,
    limit: int | None = None,
    batch_size: int = 8,
    dtype: str = "fp32",
    group=None,
    pad_multiple: int = 1,
) -> dict[str, TaskScore]:
    """Load the named tasks (the first `limit` questions of each) and score them; see score_questions."""
    tasks = {name: load_task(name, limit) for name in names}
    return score_questions(model, tokenizer, tasks, device, max_len=max_len, batch_size=batch_size, dtype=dtype,
                           group=group, pad_multiple=pad_multiple)


def format_table(results: dict[str, TaskScore]) -> str:
    """A plain-text table: task, questions, acc, acc_norm (percent)."""
    lines = [f"{'task':<16}{'n':>7}{'acc':>9}{'acc_norm':>10}"]
    for name, score in results.items():
        lines.append(f"{name:<16}{score.questions:>7}{100 * score.acc:>8.1f}%{100 * score.acc_norm:>9.1f}%")
    return "\n".join(lines)
