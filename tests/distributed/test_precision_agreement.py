"""train.dtype=auto is each rank's own reading of its device (on a CPU, a timing): the ranks of one job train in
rank 0's choice whatever each read, since ranks in different dtypes would exchange gradients that do not match."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _agreed(rank: int, world: int, read: list[str], requested: str) -> str:
    import torch

    from optimus.train.precision import Precision, agree_on_precision

    return agree_on_precision(Precision(read[rank], requested, "a probe"), torch.device("cpu")).dtype


@pytest.mark.parametrize("read", [["fp32", "bf16"], ["bf16", "fp32"]])
def test_every_rank_takes_rank_0s_reading_of_auto(read):
    assert run_distributed(_agreed, 2, read, "auto") == [read[0], read[0]]


def test_an_explicit_dtype_is_left_as_each_rank_has_it():
    """(one config gives every rank the same explicit dtype: nothing to agree on, nothing exchanged)"""
    assert run_distributed(_agreed, 2, ["fp32", "bf16"], "bf16") == ["fp32", "bf16"]


def _trainer_precision(rank: int, world: int, run_dir: str) -> tuple[str, str]:
    import os

    from optimus.train import trainer as trainer_module
    from optimus.train.precision import Precision
    from tests.helpers.runs import small_moe_trainer_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # rank 1 reads its CPU as a native-bf16 one, rank 0 not (a probe either side of the line)
    trainer_module.choose_precision = lambda requested, device, cpu=None: Precision(
        "bf16" if rank == 1 else "fp32", requested, "a probe")
    config = small_moe_trainer_config(run_dir, 1, {"dp_shard": 2})
    config = config.model_copy(update={"train": config.train.model_copy(update={"dtype": "auto"})})
    trainer = trainer_module.Trainer(config, progress_bar=False)
    return trainer.precision.dtype, trainer.config.train.dtype


def test_the_trainer_trains_every_rank_in_rank_0s_choice(tmp_path):
    assert run_distributed(_trainer_precision, 2, str(tmp_path / "run")) == [("fp32", "fp32")] * 2
