"""Downstream evaluation inside the training loop: `train.eval_tasks`, every `train.eval_every` steps.

Every rank calls `downstream_accuracies` (the forwards of a sharded model are collective); each
data-parallel rank scores its slice and every rank returns the same numbers, which the trainer
logs from rank 0 beside the held-out loss.
"""

from __future__ import annotations

import torch
from torch import nn

from optimus.eval.scoring import evaluate_tasks


def downstream_accuracies(model: nn.Module, config, device: torch.device, mesh=None) -> dict[str, dict] | None:
    """{task: {"acc", "acc_norm", "n"}} of the current weights for config.train.eval_tasks (None when none)."""
    from optimus.data.sources import load_tokenizer
    from optimus.parallel.pipeline import get_pipeline

    train = config.train
    if not train.eval_tasks:
        return None
    if get_pipeline(model) is not None:  # parallel/validate.py refuses the combination; this is a backstop
        raise ValueError("train.eval_tasks cannot run under pipeline parallelism: no rank holds the whole model")
    group = mesh["dp"].get_group() if mesh is not None and mesh.size("dp") > 1 else None
    tp = mesh.size("tp") if mesh is not None else 1
    results = evaluate_tasks(model, load_tokenizer(config.data.tokenizer), train.eval_tasks, device,
                             max_len=train.seq_len, limit=train.eval_tasks_limit,
                             batch_size=train.micro_batch_size or 8, dtype=train.dtype, group=group, pad_multiple=tp)
    return {name: score.as_record() for name, score in results.items()}
