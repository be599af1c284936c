"""Vocabulary-parallel LM head and cross-entropy (parallel/vocab_parallel.py) against one process.

The op and the head alone (uneven vocabularies, a rank with no rows, ignored tokens, several chunks,
with and without sequence parallelism), whole models at tp=2 with a vocabulary tp does not divide,
and a check that no rank ever holds full-vocabulary logits in the loss path. Layout tolerances are
those of tests.helpers.parity; the op's own are fp32 rounding of a 23 x 37 problem.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.parity import check_layout, tiny_config

pytestmark = pytest.mark.distributed


def _problem(vocab: int, n: int = 23, d: int = 8, scale: float = 2.0):
    torch.manual_seed(0)
    h = torch.randn(n, d, dtype=torch.float64).float()
    weight = torch.randn(vocab, d) * scale
    labels = torch.randint(0, vocab, (n,))
    labels[[1, 7, 8]] = -100
    return h, weight, labels


def _op_matches_reference(rank: int, world: int, vocab: int, chunk_rows: int, bf16: bool = False,
                          scale: float = 2.0) -> list[int]:
    import torch.distributed as dist

    from optimus.ops.cross_entropy import linear_cross_entropy_reference
    from optimus.parallel.vocab_parallel import vocab_parallel_cross_entropy, vocab_split

    h, weight, labels = _problem(vocab, scale=scale)
    autocast = torch.autocast("cpu", torch.bfloat16, enabled=bf16)
    h_ref, w_ref = h.clone().requires_grad_(), weight.clone().requires_grad_()
    with autocast:
        want = linear_cross_entropy_reference(h_ref, w_ref, labels)
    want.backward()
    sizes = vocab_split(vocab, world)
    start = sum(sizes[:rank])
    h_mine = h.clone().requires_grad_()
    w_mine = weight[start:start + sizes[rank]].clone().requires_grad_()
    with autocast:
        got = vocab_parallel_cross_entropy(h_mine, w_mine, labels, start, dist.group.WORLD, chunk_rows=chunk_rows)
    got.backward()
    # bf16: both sides round the logits to bf16; the softmax and sums are fp32 in both. Logits near 1e3 carry fp32
    # rounding of ~1e-4 each (two summation orders), which the softmax passes on to the gradients at ~1e-3 relative;
    # without the maximum taken out they would be inf or nan
    if bf16:
        tol = dict(rtol=1e-2, atol=2e-3)
    else:
        tol = dict(rtol=2e-3, atol=2e-2) if scale > 10 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got, want, **(dict(rtol=1e-3, atol=1e-3) if bf16 else dict(rtol=1e-6, atol=1e-6)))
    torch.testing.assert_close(h_mine.grad, h_ref.grad, **tol)
    torch.testing.assert_close(w_mine.grad, w_ref.grad[start:start + sizes[rank]], **tol)
    return sizes


# logits-near-1e3: exp() of such logits overflows fp32 unless each rank's maximum is taken out first
@pytest.mark.parametrize("world,vocab,chunk_rows,bf16,scale", [
    (2, 37, 5, False, 2.0), (3, 4, 64, False, 2.0), (2, 37, 5, True, 2.0), (2, 37, 5, False, 300.0)],
    ids=["uneven-5-chunks", "a-rank-without-rows", "bf16-autocast", "logits-near-1e3"])
def test_vocab_parallel_cross_entropy_is_the_full_vocabulary_loss(world, vocab, chunk_rows, bf16, scale):
    sizes = run_distributed(_op_matches_reference, world, vocab, chunk_rows, bf16, scale)[0]
    assert sum(sizes) == vocab and len(set(sizes)) > 1  # really uneven (and [2, 2, 0] has an empty rank)


def _head_matches_lm_head(rank: int, world: int, sequence_parallel: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from optimus.models.layers import LMHead
    from optimus.parallel.vocab_parallel import VocabParallelLMHead

    torch.manual_seed(0)
    batch, seq, d, vocab = 2, 6, 8, 29
    head = LMHead(d, vocab)
    h = torch.randn(batch, seq, d, requires_grad=True)
    labels = torch.randint(0, vocab, (batch, seq))
    labels[0, 2] = -100
    want_logits = head(h)
    want_loss = head.cross_entropy(h, labels)
    (want_loss + want_logits.square().mean()).backward()

    parallel = VocabParallelLMHead(head, init_device_mesh("cpu", (world,)), sequence_parallel, chunk_rows=4)
    tokens = slice(rank * seq // world, (rank + 1) * seq // world) if sequence_parallel else slice(None)
    h_mine = h.detach()[:, tokens].clone().requires_grad_()
    got_logits = parallel(h_mine)
    got_loss = parallel.cross_entropy(h_mine, labels)
    (got_loss + got_logits.square().mean()).backward()
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h_mine.grad, h.grad[:, tokens], rtol=1e-5, atol=1e-7)
    # the weight is one DTensor of the single-device shape: checkpoints see the same key and shape
    assert parallel.weight.shape == head.weight.shape
    torch.testing.assert_close(parallel.weight.grad.full_tensor(), head.weight.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel", "replicated-tokens"])
def test_vocab_parallel_head_gives_the_single_device_logits_loss_and_gradients(sequence_parallel):
    run_distributed(_head_matches_lm_head, 2, sequence_parallel)


def _embedding_matches_embedding(rank: int, world: int, sequence_parallel: bool) -> int:
    """VocabParallelEmbedding against nn.Embedding: outputs (this rank's tokens), the weight's gradient, and the
    largest tensor its backward allocates (returned: the profiler's allocation events)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from optimus.parallel.vocab_parallel import VocabParallelEmbedding

    torch.manual_seed(0)
    # a vocabulary several times the tokens: the sequence-parallel backward all-gathers the [2, 6, 8] token
    # gradients (384 bytes, read as 768 when gloo's worker thread frees its buffer unseen by the profiler), well
    # under one rank's 51 rows, so only a whole-vocabulary gradient could break the bound below
    batch, seq, d, vocab = 2, 6, 8, 101
    embed = torch.nn.Embedding(vocab, d)
    ids = torch.randint(0, vocab, (batch, seq))
    grad_out = torch.randn(batch, seq, d)
    (embed(ids) * grad_out).sum().backward()

    parallel = VocabParallelEmbedding(embed, init_device_mesh("cpu", (world,)), sequence_parallel)
    tokens = slice(rank * seq // world, (rank + 1) * seq // world) if sequence_parallel else slice(None)
    out = parallel(ids)
    torch.testing.assert_close(out, embed(ids)[:, tokens].detach(), rtol=0, atol=1e-6)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (out * grad_out[:, tokens]).sum().backward()
    assert parallel.weight.shape == embed.weight.shape  # checkpoints see the single-device key and shape
    torch.testing.assert_close(parallel.weight.grad.full_tensor(), embed.weight.grad, rtol=1e-6, atol=1e-6)
    return max((e.cpu_memory_usage for e in prof.events()), default=0)


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sequence-parallel", "replicated-tokens"])
def test_vocab_parallel_embedding_gives_the_single_device_output_and_gradient(sequence_parallel):
    """...and its backward allocates no more than this rank's rows: torch's RowwiseParallel embedding built a
    dense gradient of the whole vocabulary on every rank (101 x 8 fp32 here, 412 MB at V = 50k, D = 2,048)."""
    largest = run_distributed(_embedding_matches_embedding, 2, sequence_parallel)
    assert 0 < max(largest) <= 51 * 8 * 4  # the larger rank's [51, 8] fp32 rows


def test_tp_2_with_a_vocabulary_tp_does_not_divide_matches_one_process():
    # 1,001 rows: 501 on rank 0, 500 on rank 1 (embedding and head alike); no padding token
    check_layout(tiny_config(model=dict(vocab_size=1001), parallel=dict(tp=2)), world_size=2, steps=3)


@pytest.mark.slow  # extra coverage: the uneven head under FSDP's 2-D (dp_shard x tp) sharding
def test_tp_2_dp_shard_2_with_an_uneven_vocabulary_matches_one_process():
    check_layout(tiny_config(moe=True, model=dict(vocab_size=1001), parallel=dict(tp=2, dp_shard=2)),
                 world_size=4, steps=3)


@pytest.mark.slow  # extra coverage: activation checkpointing and HSDP with the vocab-parallel head
def test_tp_2_hsdp_with_selective_recompute_matches_one_process():
    train = dict(activation_checkpointing="selective", recompute=["attention", "mlp", "norms"])
    check_layout(tiny_config(parallel=dict(tp=2, dp_replicate=2), train=train), world_size=4, steps=3)


def _widest_logits(rank: int, world: int, config, chunk_rows: int) -> dict:
    """Shapes of every tensor ops produce whose last dim is a vocabulary width, in a training forward and
    backward, and in a forward that asks for the logits."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model
    from tests.helpers.parity import global_batches

    vocab = config.model.vocab_size

    class VocabWideOutputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.is_view:  # e.g. the transposed weight [D, V/tp]: no new memory
                return out
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2 and leaf.shape[-1] in (vocab, vocab // world):
                    self.shapes.append(tuple(leaf.shape))
            return out

    dims = ParallelDims(tp=world, world_size=world)
    model = build_parallel_model(config, dims, dims.build_mesh("cpu"), torch.device("cpu"))
    model.lm_head.chunk_rows = chunk_rows
    inputs, labels = global_batches(config, 1)[0]
    inputs, labels = inputs[:2], labels[:2]
    with VocabWideOutputs() as training:
        model(inputs, labels).loss.backward()
    with VocabWideOutputs() as asking, torch.no_grad():
        model(inputs)
    model.lm_head.chunk_rows = 100 * inputs.numel()  # a chunk larger than the tokens: buffers of the tokens' rows
    with VocabWideOutputs() as one_chunk:
        model(inputs, labels).loss.backward()
    return {"training": training.shapes, "logits": asking.shapes, "one chunk": one_chunk.shapes}


def test_no_rank_holds_full_vocabulary_logits_in_the_loss_path():
    config = tiny_config(parallel=dict(tp=2))
    vocab, chunk_rows = config.model.vocab_size, 16
    tokens = 2 * config.train.seq_len
    for seen in run_distributed(_widest_logits, 2, config, chunk_rows):
        # the loss worked on [<= chunk_rows, V/2] pieces only, chunk after chunk
        assert seen["training"], "no vocab-wide op seen: the check would pass vacuously"
        assert all(shape[-1] == vocab // 2 and shape[0] <= chunk_rows for shape in seen["training"]), seen["training"]
        assert sum(1 for shape in seen["training"] if shape[0] == chunk_rows) >= tokens // chunk_rows
        # asking for logits gathers them: the detector sees full rows then (so it can fail)
        assert any(shape[-1] == vocab for shape in seen["logits"]), seen["logits"]
        # chunk_rows is a bound, not a size: fewer tokens than a chunk get buffers of their rows only, not
        # [chunk_rows, V/tp] ones whatever the batch
        assert seen["one chunk"] and all(shape[0] <= tokens for shape in seen["one chunk"]), seen["one chunk"]
