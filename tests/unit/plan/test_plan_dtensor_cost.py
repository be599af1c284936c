"""Tensor parallelism's DTensor dispatch on a CPU: the counted operators per block are what tp runs, the measured
cost is per operator, and step_time charges it only under tp."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.local_ranks import run_on_local_ranks
from optimus.plan.dtensor_cost import (DENSE_BLOCK_DTENSOR_OPS, MOE_BLOCK_DTENSOR_OPS, ROOT_DTENSOR_OPS,
                                       dtensor_operators, measure_dtensor_overhead)

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def _count_dtensor_ops(rank: int, world: int, config_name: str, layers: int) -> list[int]:
    """(each forked rank) DTensor operators of one forward and of its backward under tp = world."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from optimus.models.transformer import build_model
    from optimus.parallel.tensor_parallel import apply_tensor_parallel
    from optimus.plan.timing import CountOps

    config = load_config(CONFIGS / config_name, ["--train.dtype=fp32", f"--model.n_layers={layers}",
                                                 "--model.vocab_size=512"])
    model = apply_tensor_parallel(build_model(config.model, device="cpu", seed=0), init_device_mesh("cpu", (world,)))
    ids = torch.randint(0, 512, (2, 32))
    with CountOps(only=DTensor) as forward:
        loss = model(ids, labels=ids).loss
    with CountOps(only=DTensor) as backward:
        loss.backward()
    return [forward.count, backward.count]


@pytest.mark.parametrize("config_name, block", [("mula-tiny-dense.yaml", DENSE_BLOCK_DTENSOR_OPS),
                                                ("mula-tiny-moe.yaml", MOE_BLOCK_DTENSOR_OPS)])
def test_counted_dtensor_operators_are_what_tp_runs(config_name, block):
    for layers in (1, 2):
        counted = run_on_local_ranks(_count_dtensor_ops, 2, config_name, layers, timeout=120.0)
        expected = [root + layers * per_block for root, per_block in zip(ROOT_DTENSOR_OPS, block)]
        assert counted == [expected, expected]
    config = load_config(CONFIGS / config_name, [])
    assert dtensor_operators(config, 2, recompute=False, root=True) == sum(ROOT_DTENSOR_OPS) + 2 * sum(block)
    # a recomputed forward runs the block's forward operators again
    assert dtensor_operators(config, 2, True, False) - dtensor_operators(config, 2, False, False) == 2 * block[0]


def test_dtensor_overhead_is_measured_per_operator_of_one_block():
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.seq_len=32",
                                                             "--train.micro_batch_size=2"])
    timed = measure_dtensor_overhead(config, "fp32")
    assert timed["operators"] == sum(ROOT_DTENSOR_OPS) + sum(DENSE_BLOCK_DTENSOR_OPS)
    assert timed["seconds_plain"] > 0 and timed["seconds_tp"] > 0 and timed["seconds_extra"] >= 0
    assert timed["us_per_operator"] == pytest.approx(1e6 * timed["seconds_extra"] / timed["operators"])


def test_a_wide_model_is_timed_on_a_narrow_block_of_the_same_structure():
    from optimus.plan.dtensor_cost import MEASURE_MAX_EXPERTS, MEASURE_MAX_WIDTH, MEASURE_VOCAB, measured_block

    wide = load_config(CONFIGS / "mula-220b-a10b.yaml", []).model  # 240 experts: 14 GB for one fp32 block
    block = measured_block(wide)
    assert (block.n_layers, block.vocab_size, block.d_model) == (1, MEASURE_VOCAB, MEASURE_MAX_WIDTH)
    assert block.head_dim == wide.head_dim and block.n_experts == MEASURE_MAX_EXPERTS
    assert block.expert_ffn_hidden == wide.expert_ffn_hidden * MEASURE_MAX_WIDTH // wide.d_model
    tiny = load_config(CONFIGS / "mula-tiny-dense.yaml", []).model
    assert measured_block(tiny).d_model == tiny.d_model and measured_block(tiny).ffn_hidden == tiny.ffn_hidden


def test_step_time_charges_dtensor_dispatch_only_under_tp():
    from dataclasses import replace

    from optimus.parallel.validate import validate_layout
    from tests.helpers.plan import toy_cluster
    from optimus.plan.efficiency import Efficiency
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import step_time

    cluster = toy_cluster(devices_per_node=2)
    efficiency = Efficiency(dtensor_overhead_us=100.0)
    for tp, world in ((2, 2), (1, 1)):
        config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.micro_batch_size=8",
                                                                 f"--parallel.tp={tp}"])
        layout = validate_layout(config, world)
        shape = ModelShape.of(layout.config)
        charged = step_time(layout.config, layout.dims, shape, cluster, efficiency, 1)
        free = step_time(layout.config, layout.dims, shape, cluster, replace(efficiency, dtensor_overhead_us=0.0), 1)
        expected = 100e-6 * dtensor_operators(layout.config, 4, False, True) if tp > 1 else 0.0
        assert charged.parts["tp_dispatch"] == pytest.approx(expected)
        assert charged.step_s - free.step_s == pytest.approx(expected)


def test_a_micro_batchs_dtensor_operators_add_the_roots_only_on_the_stage_holding_it():
    from optimus.config import load_config
    from optimus.plan.dtensor_cost import (DENSE_BLOCK_DTENSOR_OPS, ROOT_DTENSOR_OPS, dtensor_operators,
                                           measured_block)

    dense = load_config(CONFIGS / "mula-tiny-dense.yaml", [])
    block = sum(DENSE_BLOCK_DTENSOR_OPS)
    assert dtensor_operators(dense, 2, False, False) == 2 * block
    assert dtensor_operators(dense, 2, False, True) == 2 * block + sum(ROOT_DTENSOR_OPS)
    # a width that is no multiple of the timed one is timed whole (narrowing it would change its heads' width)
    wide = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--model.d_model=768", "--model.n_heads=8"]).model
    assert (measured_block(wide).d_model, measured_block(wide).n_heads) == (768, 8)
