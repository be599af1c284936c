"""The small collectives of a training step, counted on gloo against what the planner prices
(optimus/plan/step_collectives.py): every collective one whole step of the Trainer runs (its callbacks' too)
outside the forward and backward and the data-parallel buckets, by operation and group size.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.distributed

# what a step's forward and backward run, and the sharded optimizer's buckets: priced by step_time's other parts
ELSEWHERE = ("c10d._reduce_scatter_base_", "c10d._allgather_base_")
MOE = dict(n_experts=4, top_k=2, expert_ffn_hidden=16, n_heads=4)
CASES = {  # name: (moe, parallel), 4 ranks
    "fsdp2-tp2": (False, dict(dp_shard=2, tp=2)),
    "zero1-2-tp2": (False, dict(dp_shard=2, tp=2, shard_mode="zero1")),
    "hsdp2x2": (False, dict(dp_replicate=2, dp_shard=2)),
    "ddp4": (False, dict(dp_shard=4, shard_mode="ddp")),
    "replicate2-pp2": (False, dict(dp_replicate=2, pp=2)),
    "moe-zero1-4-ep2": (True, dict(dp_shard=4, ep=2, shard_mode="zero1")),
    "moe-fsdp4-ep2": (True, dict(dp_shard=4, ep=2)),
    "moe-fsdp2-tp2-ep2": (True, dict(dp_shard=2, tp=2, ep=2)),
    "moe-pp2-fsdp2-ep2": (True, dict(pp=2, dp_shard=2, ep=2)),
}
# make test-slow's cases: their shard modes and dimensions each run in a make-test case too (fsdp x tp and fsdp x ep
# in moe-fsdp2-tp2-ep2, zero1 in zero1-2-tp2), in other combinations
SLOW_CASES = ("fsdp2-tp2", "moe-zero1-4-ep2", "moe-fsdp4-ep2")


def _group_size(op: str, args) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if op.startswith("_c10d_functional."):  # (tensor, reduce op, group name)
        return _resolve_process_group(args[2]).size()
    # c10d's ops take the group boxed as a ScriptObject
    return next(dist.ProcessGroup.unbox(a) for a in args
                if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())).size()


def _counted_steps(rank: int, world: int, run_root: str, token_dir: str,
                   names: list[str]) -> dict[str, dict[str, int]]:
    import os

    from torch.utils._python_dispatch import TorchDispatchMode

    import optimus.train.step as step_module
    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # as torchrun would
    phase = ["step"]
    real_record_function = step_module.record_function

    class Phase:  # train_step names its phases for profilers: the forward and backward's are left out here
        def __init__(self, name):
            self.name, self.inner = name, real_record_function(name)

        def __enter__(self):
            self.outer, phase[0] = phase[0], self.name
            return self.inner.__enter__()

        def __exit__(self, *exc):
            phase[0] = self.outer
            return self.inner.__exit__(*exc)

    class Collectives(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: Counter = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            op = str(func).removesuffix(".default")
            if (op.startswith(("c10d.", "_c10d_functional.")) and "wait" not in op and "wrap" not in op
                    and op not in ELSEWHERE and phase[0] != "optimus.forward_backward"):
                self.calls[f"{op.split('.')[-1].strip('_')} over {_group_size(op, args)}"] += 1
            return func(*args, **(kwargs or {}))

    from optimus.parallel.pipeline import PipelineRuntime

    real_gather_terms = PipelineRuntime._gather_terms

    def gather_terms(self, *args):  # the pipeline's loss terms, reduced once a step inside its forward and backward
        with Phase("pipeline terms"):
            return real_gather_terms(self, *args)

    step_module.record_function, PipelineRuntime._gather_terms = Phase, gather_terms
    counted = {}
    try:
        for name in names:
            moe, parallel = CASES[name]
            train = dict(max_steps=3, global_batch_size=8, ckpt_every=0, log_every=1)
            model = dict(n_layers=2, **(MOE if moe else {}))
            config = build_config(tiny_run_config(f"{run_root}/{name}", token_dir, train=train, model=model,
                                                  parallel=parallel, resilience={}))
            trainer = Trainer(config, progress_bar=False)
            mode, one_step = Collectives(), trainer._one_step

            def counted_step(step, mode=mode, one_step=one_step):  # the 2nd step and what follows it, whole
                if step == 2:
                    mode.__enter__()
                elif step == 3:
                    mode.__exit__(None, None, None)
                one_step(step)

            trainer._one_step = counted_step
            trainer.fit()
            counted[name] = dict(mode.calls)
    finally:
        step_module.record_function, PipelineRuntime._gather_terms = real_record_function, real_gather_terms
    return counted


def _priced(name: str, world: int) -> dict[str, int]:
    from optimus.config import build_config
    from optimus.parallel.mesh import ParallelDims
    from optimus.plan.comms import mesh_sizes
    from optimus.plan.step_collectives import step_collectives
    from tests.helpers.runs import tiny_run_config

    moe, parallel = CASES[name]
    config = build_config(tiny_run_config("run", "tokens", train=dict(global_batch_size=8, log_every=1),
                                          model=dict(n_layers=2, **(MOE if moe else {})), parallel=parallel,
                                          resilience={}))
    dims = ParallelDims.from_config(config.parallel, world)
    sizes, priced = mesh_sizes(dims), Counter()
    for call in step_collectives(config, dims, config.model.n_layers // dims.pp):
        size = math.prod(sizes[d] for d in call.group)
        if size > 1:
            priced[f"{'allgather' if call.op == 'all_gather' else 'allreduce'} over {size}"] += int(call.per_step)
    return dict(priced)


@pytest.mark.parametrize("slow", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["make-test", "slow"])
def test_every_small_collective_of_a_step_is_priced(tmp_path, small_token_dir, slow):
    names = [name for name in CASES if (name in SLOW_CASES) == slow]
    counted = run_distributed(_counted_steps, 4, str(tmp_path), str(small_token_dir), names, timeout=300)[0]
    for name in names:
        # funcol's all_reduce and c10d's allreduce_ are one operation to the planner
        measured = Counter()
        for key, calls in counted[name].items():
            measured[key.replace("all_reduce", "allreduce")] += calls
        assert dict(measured) == _priced(name, 4), name
