"""The training loop's downstream evaluation (optimus/eval/loop.py) hands the scorer the run's layout."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from optimus.eval.loop import downstream_accuracies
from optimus.eval.scoring import TaskScore


class _Mesh:
    """The two DeviceMesh calls the loop makes, for a layout of `sizes` (no process group needed)."""

    def __init__(self, **sizes: int):
        self.sizes = sizes

    def size(self, dim: str) -> int:
        return self.sizes.get(dim, 1)

    def __getitem__(self, dim: str):
        raise AssertionError(f"no {dim} group is needed when that dimension has one rank")


def test_tensor_parallel_eval_pads_to_the_tp_degree(monkeypatch):
    """Sequence parallelism splits each scored batch over the TP ranks: the loop must ask for widths that divide."""
    calls = []

    def fake_evaluate_tasks(model, tokenizer, names, device, **kwargs):
        calls.append(kwargs)
        return {name: TaskScore(acc=1.0, acc_norm=0.5, questions=3) for name in names}

    monkeypatch.setattr("optimus.eval.loop.evaluate_tasks", fake_evaluate_tasks)
    monkeypatch.setattr("optimus.data.sources.load_tokenizer", lambda name: "tokenizer")
    train = SimpleNamespace(eval_tasks=["copa"], seq_len=64, eval_tasks_limit=3, micro_batch_size=2, dtype="bf16")
    config = SimpleNamespace(train=train, data=SimpleNamespace(tokenizer="olmoe"))
    result = downstream_accuracies(torch.nn.Linear(2, 2), config, torch.device("cpu"), _Mesh(tp=4))
    assert result == {"copa": {"acc": 1.0, "acc_norm": 0.5, "n": 3}}
    assert calls[0]["pad_multiple"] == 4 and calls[0]["group"] is None
    # the run's own window, micro-batch and dtype (scored under bf16 autocast as the model trains, not in fp32)
    assert (calls[0]["max_len"], calls[0]["limit"], calls[0]["batch_size"], calls[0]["dtype"]) == (64, 3, 2, "bf16")
