"""The busiest expert-holding rank's share of each layer's token copies, as a run logs it and says it at the end."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from optimus.train.callbacks.step_metrics import ExpertLoadMetrics
from optimus.train.metrics import busiest_block_share


def test_busiest_block_share_per_layer():
    counts = torch.tensor([[10, 20, 5, 5], [5, 5, 10, 20], [10, 10, 10, 10], [0, 0, 0, 0]])
    # 2 blocks of 2 experts: 30 of 40 copies (1.5x), 30 of 40, 20 of 40 (even); a layer that routed none: 1.0
    assert busiest_block_share(counts, 2).tolist() == pytest.approx([1.5, 1.5, 1.0, 1.0])
    # 4 blocks of one expert: 20 of a balanced 10
    assert busiest_block_share(counts, 4).tolist() == pytest.approx([2.0, 2.0, 1.0, 1.0])
    assert busiest_block_share(counts, 1).tolist() == pytest.approx([1.0] * 4)
    with pytest.raises(ValueError, match="4 experts do not split into 3 equal blocks"):
        busiest_block_share(counts, 3)


def _log(callback, step, counts):
    record = {}
    callback.on_log(step, SimpleNamespace(expert_counts=torch.tensor(counts)), record)
    return record


def test_a_run_whose_ranks_split_the_experts_logs_the_busiest_ones_share_and_says_its_mean():
    said = []
    callback = ExpertLoadMetrics(expert_blocks=2, say=said.append)
    first = _log(callback, 1, [[10, 20, 5, 5], [10, 10, 10, 10]])  # 1.5x and 1.0x
    second = _log(callback, 2, [[10, 10, 10, 10], [10, 10, 10, 10]])  # even
    assert first["expert_rank_load_max"] == 1.5 and first["expert_rank_load_mean"] == 1.25
    assert second["expert_rank_load_max"] == 1.0 and "expert_counts" in second
    callback.on_train_end(2)
    assert said == ["routing: the busiest of the 2 expert shards (ep x tp) received 1.12x its even share of "
                    "a layer's token copies (mean over 2 logged steps; 1.50x in the worst layer); "
                    "`optimus plan --moe-imbalance 1.12` prices that"]


def test_one_rank_holding_every_expert_logs_no_rank_share_and_a_failed_run_says_nothing():
    said = []
    whole = ExpertLoadMetrics(expert_blocks=1, say=said.append)
    assert "expert_rank_load_max" not in _log(whole, 1, [[10, 20, 5, 5]])
    whole.on_train_end(1)
    failed = ExpertLoadMetrics(expert_blocks=2, say=said.append)
    _log(failed, 1, [[10, 20, 5, 5]])
    failed.on_error(RuntimeError("lost"))
    failed.on_train_end(1)
    dense = ExpertLoadMetrics(expert_blocks=2, say=said.append)
    record = {"loss": 1.0}
    dense.on_log(1, SimpleNamespace(expert_counts=None), record)
    assert record == {"loss": 1.0}  # no counts, no fields
    dense.on_train_end(1)
    assert said == []


def test_the_end_of_run_line_names_the_run_whose_counts_price_other_splits():
    """`optimus plan --moe-routing RUN` prices every layout's split at the counts RUN logged: a run says so, also
    where one rank held every expert (a one-process pilot run)."""
    said = []
    split = ExpertLoadMetrics(expert_blocks=2, say=said.append, run_dir=Path("runs/pilot"))
    _log(split, 1, [[10, 20, 5, 5]])
    split.on_train_end(1)
    whole = ExpertLoadMetrics(expert_blocks=1, say=said.append, run_dir=Path("runs/pilot"))
    _log(whole, 1, [[10, 20, 5, 5]])
    whole.on_train_end(1)
    assert said == ["routing: the busiest of the 2 expert shards (ep x tp) received 1.50x its even share of a layer's "
                    "token copies (mean over 1 logged steps; 1.50x in the worst layer); `optimus plan --moe-imbalance "
                    "1.50` prices that (`--moe-routing runs/pilot`: each layout at its own split)",
                    "routing: `optimus plan CONFIG --moe-routing runs/pilot` prices every layout at the expert counts "
                    "this run logged (each at its own split of the experts over ep x tp ranks)"]
