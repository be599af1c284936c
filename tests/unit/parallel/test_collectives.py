"""optimus.parallel.collectives calls torch.distributed's function as it is at the call, not as it was at import:
a wrapper installed later (benchmarks/_common.CollectiveCounter, a tracer) sees every call."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from optimus.parallel import collectives


@pytest.mark.parametrize("ours, new, old", [
    (collectives.reduce_scatter_single, "reduce_scatter_single", "reduce_scatter_tensor"),
    (collectives.all_gather_single, "all_gather_single", "all_gather_into_tensor"),
])
def test_a_wrapper_installed_after_import_sees_the_call(monkeypatch, ours, new, old):
    seen = []
    name = new if hasattr(dist, new) else old  # the name this torch has
    monkeypatch.setattr(dist, name, lambda output, input, **kwargs: seen.append((output, input, kwargs)) or "work")
    assert ours("out", "in", group="g", async_op=True) == "work"
    assert seen == [("out", "in", {**({"op": dist.ReduceOp.SUM} if "reduce" in new else {}), "group": "g",
                                   "async_op": True})]


def test_the_reduce_op_asked_for_is_the_one_passed_on(monkeypatch):
    """Every caller today sums; an op asked for (an average, a max) must still reach torch, not the default."""
    seen = []
    name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    monkeypatch.setattr(dist, name, lambda output, input, **kwargs: seen.append(kwargs["op"]))
    collectives.reduce_scatter_single("out", "in", op=dist.ReduceOp.MAX)
    assert seen == [dist.ReduceOp.MAX]
