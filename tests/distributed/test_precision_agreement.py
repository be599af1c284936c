"""train.dtype=auto is each rank's own reading of its device (on a CPU, a timing): the ranks of one job train in
rank 0's choice whatever each read, since ranks in different dtypes would exchange gradients that do not match."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed


def _agreed(rank: int, world: int, read: list[str], requested: str) -> tuple[str, str | None]:
    import torch

    from optimus.train.precision import Precision, agree_on_precision

    agreed = agree_on_precision(Precision(read[rank], requested, "a probe"), torch.device("cpu"))
    return agreed.dtype, agreed.warning


@pytest.mark.parametrize("read", [["fp32", "bf16"], ["bf16", "fp32"]])
def test_every_rank_takes_rank_0s_reading_of_auto(read):
    (first, _), (second, warning) = run_distributed(_agreed, 2, read, "auto")
    assert first == second == read[0]
    # a rank made to emulate bf16 says so (it sets the job's pace); one made to run fp32 loses nothing
    assert (warning is not None) == (read[0] == "bf16")
    if warning:
        assert warning.startswith("warning: rank 1 trains in bf16, rank 0's choice") and "train.dtype=fp32" in warning


def test_an_explicit_dtype_is_left_as_each_rank_has_it():
    """(one config gives every rank the same explicit dtype: nothing to agree on)"""
    assert [dtype for dtype, _ in run_distributed(_agreed, 2, ["fp32", "bf16"], "bf16")] == ["fp32", "bf16"]


def _explicit_bf16(rank: int, world: int, native: list[bool]) -> tuple[str | None, bool]:
    import torch

    from optimus.train.precision import Precision, agree_on_precision

    warning = None if native[rank] else "warning: train.dtype=bf16 on a device without native bf16 (x)"
    agreed = agree_on_precision(Precision("bf16", "bf16", "a probe", warning), torch.device("cpu"))
    return agreed.warning, agreed.own_warning


@pytest.mark.parametrize("native", [[True, False], [False, False], [False, True], [True, True]])
def test_an_explicit_bf16_on_a_rank_without_its_units_unlike_rank_0_is_that_ranks_to_say(native):
    """Rank 0 says its own warning (for the ranks like it); rank 1 without bf16 units where rank 0 has them says
    its own, naming itself, once."""
    (first, first_own), (second, second_own) = run_distributed(_explicit_bf16, 2, native)
    assert (first is None) == native[0] and not first_own
    assert second_own == (native[0] and not native[1]) and (second is None) == native[1]
    if second_own:
        assert second.startswith("warning: rank 1 has no native bf16, unlike rank 0, yet train.dtype=bf16")


def _trainer_precision(rank: int, world: int, run_dir: str, rank_0_reads: str) -> tuple[str, str, str]:
    import contextlib
    import io
    import os

    from optimus.train import trainer as trainer_module
    from optimus.train.precision import Precision
    from tests.helpers.runs import small_moe_trainer_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    # the ranks read their CPUs either side of the line (rank 1 the other way from rank 0)
    other = {"fp32": "bf16", "bf16": "fp32"}[rank_0_reads]
    trainer_module.choose_precision = lambda requested, device, cpu=None: Precision(
        rank_0_reads if rank == 0 else other, requested, "a probe")
    config = small_moe_trainer_config(run_dir, 1, {"dp_shard": 2})
    config = config.model_copy(update={"train": config.train.model_copy(update={"dtype": "auto"})})
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        trainer = trainer_module.Trainer(config, progress_bar=False)
    return trainer.precision.dtype, trainer.config.train.dtype, said.getvalue()


@pytest.mark.parametrize("rank_0_reads", ["fp32", "bf16"])
def test_the_trainer_trains_every_rank_in_rank_0s_choice(tmp_path, rank_0_reads):
    """And rank 1, made to emulate bf16, says so itself (rank 0 does not know): one line, its own."""
    ranks = run_distributed(_trainer_precision, 2, str(tmp_path / "run"), rank_0_reads)
    assert [(dtype, trained) for dtype, trained, _ in ranks] == [(rank_0_reads, rank_0_reads)] * 2
    warned = [line for line in ranks[1][2].splitlines() if line.startswith("warning: rank 1 trains in bf16")]
    assert len(warned) == (rank_0_reads == "bf16") and "warning: rank" not in ranks[0][2]


def _trainer_explicit_bf16(rank: int, world: int, run_dir: str) -> str:
    import contextlib
    import io
    import os

    from optimus.train import trainer as trainer_module
    from optimus.train.precision import Precision
    from tests.helpers.runs import small_moe_trainer_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    trainer_module.choose_precision = lambda requested, device, cpu=None: Precision(  # rank 1 lacks bf16 units
        "bf16", requested, "a probe", None if rank == 0 else "warning: train.dtype=bf16 on a device without ...")
    config = small_moe_trainer_config(run_dir, 1, {"dp_shard": 2})
    config = config.model_copy(update={"train": config.train.model_copy(update={"dtype": "bf16"})})
    said = io.StringIO()
    with contextlib.redirect_stderr(said):
        trainer_module.Trainer(config, progress_bar=False)
    return said.getvalue()


def test_the_trainers_rank_without_bf16_units_says_so_under_an_explicit_bf16(tmp_path):
    said = run_distributed(_trainer_explicit_bf16, 2, str(tmp_path / "run"))
    assert [line for line in said[1].splitlines() if line.startswith("warning: rank 1 has no native bf16")]
    assert "warning" not in said[0]
