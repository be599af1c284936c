"""The block collectives (optimus/parallel/collective_ops.py) on CUDA tensors through NCCL: one rank, so each
op's result is known (the identity), yet the op runs NCCL's kernel, autograd's backward op, the fake impl under
torch.compile, and the trainer's op-level checkpointing policy keeps its output. Several ranks: tests/gpu/
layout_parity.py under torchrun. Run with: pytest -m gpu tests/gpu"""

import functools

import pytest
import torch
import torch.distributed as dist

from tests.helpers.dispatch import OpCounter

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA (or ROCm) GPU"),
]


@pytest.fixture(scope="module")
def nccl_group(tmp_path_factory):
    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("nccl") / "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda", 0))
    yield dist.new_group([0])
    dist.destroy_process_group()


def _ops(group):
    from optimus.parallel.collective_ops import all_gather_rows, all_reduce_sum, all_to_all_rows, reduce_scatter_rows

    return {
        "all_to_all_rows": lambda x: all_to_all_rows(x, [x.shape[0]], [x.shape[0]], group),
        "all_gather_rows": lambda x: all_gather_rows(x, group),
        "reduce_scatter_rows": lambda x: reduce_scatter_rows(x, group),
        "all_reduce_sum": lambda x: all_reduce_sum(x, group),
        "all_reduce_sum(sum_grad)": lambda x: all_reduce_sum(x, group, sum_grad=True),
    }


@pytest.mark.parametrize("name", ["all_to_all_rows", "all_gather_rows", "reduce_scatter_rows", "all_reduce_sum",
                                  "all_reduce_sum(sum_grad)"])
@pytest.mark.parametrize("compiled", [False, True])
def test_op_on_nccl_is_the_identity_forward_and_backward(nccl_group, name, compiled):
    op = _ops(nccl_group)[name]
    fn = torch.compile(lambda x: op(x * 2.0).sin(), fullgraph=True) if compiled else (lambda x: op(x * 2.0).sin())
    x = torch.randn(24, 16, device="cuda", requires_grad=True)
    out = fn(x)
    out.square().sum().backward()
    reference = x.detach().clone().requires_grad_()
    (reference * 2.0).sin().square().sum().backward()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, (reference.detach() * 2.0).sin())
    torch.testing.assert_close(x.grad, reference.grad)


def test_ops_policy_keeps_the_exchange_on_cuda(nccl_group):
    """Under the trainer's op-level policy the backward's replay runs no all_to_all again (kept), the same
    gradient as no checkpointing."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from optimus.parallel.parallelize import _ops_policy

    op = _ops(nccl_group)["all_to_all_rows"]
    weight = torch.randn(16, 16, device="cuda", requires_grad=True)

    def block(x):
        return op(x @ weight).relu() @ weight

    x = torch.randn(32, 16, device="cuda")
    exchange = "optimus.all_to_all_rows.default"
    with OpCounter() as forward:
        out = checkpoint(block, x, use_reentrant=False,
                         context_fn=functools.partial(create_selective_checkpoint_contexts, _ops_policy))
    with OpCounter() as backward:
        out.sum().backward()
    kept_grad = weight.grad.clone()
    weight.grad = None
    block(x).sum().backward()
    assert forward.calls[exchange] == 1
    assert backward.calls[exchange] == 1, "the backward ran the exchange's backward once and replayed none"
    torch.testing.assert_close(kept_grad, weight.grad)
