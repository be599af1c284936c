"""A block's collectives per micro-batch (optimus/plan/block_collectives.py) priced by hand: what each checkpointing
mode runs again, tensor parallelism's calls, expert parallelism's exchanges. (The replayed counts against a real
backward on gloo: tests/distributed/test_checkpointing_collectives.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.block_collectives import replayed_collectives, tensor_parallel_time
from optimus.plan.comms import all_reduce_time, group_link
from tests.helpers.plan import toy_cluster

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
TOY = toy_cluster()


def _tp2(*overrides: str):
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.micro_batch_size=2",
                                                              "--train.seq_len=128", "--parallel.tp=2", *overrides])
    return validate_layout(config, 2)


def test_recomputing_the_norms_alone_runs_qk_norms_two_all_reduces_again():
    """QK-norm's q and k norms all-reduce each token's sum of squares over tp (fp32, 4 bytes a token); selective
    checkpointing of the norms recomputes them, so each layer's backward runs those two all-reduces again, as a
    recomputed attention does, and nothing else of tp's."""
    plain, norms = _tp2(), _tp2("--train.activation_checkpointing=selective", "--train.recompute=[norms]")
    assert plain.config.model.qk_norm
    layers, tokens = plain.config.model.n_layers, 2 * 128
    act_bytes = tokens * plain.config.model.d_model * 4

    def tp_seconds(layout) -> float:
        return tensor_parallel_time(layout.config, layout.dims, TOY, layers, act_bytes,
                                    replayed_collectives(layout.config))
    one_all_reduce = all_reduce_time(group_link(plain.dims, ("tp",), TOY), 4 * tokens)
    assert tp_seconds(norms) - tp_seconds(plain) == pytest.approx(layers * 2 * one_all_reduce, rel=1e-9)


def test_a_micro_batchs_tensor_parallel_calls_are_counted_and_sized_as_the_model_runs_them():
    """Per block an all-gather and a reduce-scatter of the activations around attention and around the MLP, each
    mirrored in the backward (4 of each), and QK-norm's two fp32 all-reduces of a value a token, forward and
    backward; the root's: the embedding's scatter and its gather back, the LM head's gather and its scatter back,
    and the loss's gathered [2, rows] fp32 statistics of every tp rank per chunk of rows."""
    from optimus.ops.cross_entropy import DEFAULT_CHUNK_ROWS
    from optimus.plan.comms import ring_time

    layout = _tp2()
    layers, tokens, tp = layout.config.model.n_layers, 2 * 128, 2
    act_bytes = tokens * layout.config.model.d_model * 4
    link = group_link(layout.dims, ("tp",), TOY)
    gather, scatter = ring_time(link, act_bytes), ring_time(link, act_bytes, "reduce_scatter")
    rows = min(DEFAULT_CHUNK_ROWS, tokens)
    loss_statistics = -(-tokens // rows) * ring_time(link, tp * 2 * 4 * rows)
    expected = (layers * (4 * (gather + scatter) + 2 * 2 * all_reduce_time(link, 4 * tokens))
                + 2 * (gather + scatter) + loss_statistics)
    again = replayed_collectives(layout.config)
    priced = tensor_parallel_time(layout.config, layout.dims, TOY, layers, act_bytes, again)
    assert priced == pytest.approx(expected, rel=1e-9)
