"""`optimus plan --calibrate`: fit the step-time model's efficiencies and alpha-beta terms on this machine.

Collectives: calibrate_collectives.py (gloo on forked ranks, fitted to comms.py's ring formulas).

Op classes, each timed forward + backward on a rank's threads (here.rank_threads: one for each of several ranks, as
torchrun gives them; every core for a lone process) at the shapes the
planned model uses (micro-batch x sequence tokens; under tp as one tp rank holds them: its share of the
projections' outputs or inputs, of the heads and of the vocabulary; the vocab-parallel loss's own passes over
its logits are step_time's), and read against the same formula the step-time model uses:
    dense_gemm      the block's projections and its dense MLP: 6 T (in x out) FLOPs / time / peak
    grouped_gemm    the MoE expert op (optimus.ops.moe_experts_forward) with random routing, as one ep x tp rank
                    runs it (its E / (ep tp) experts, ep T k / E rows each): 18 T k d fe / tp FLOPs
    attention       causal SDPA: 12 T d S FLOPs (the model's count, masked half included) / time / peak
    loss_head       the fused LM head + cross-entropy (optimus.ops.linear_cross_entropy) on up to 1,024 of the
                    T rows (it works chunk by chunk, so its rate per row does not depend on T): 6 T d V FLOPs
    memory_bound    an RMSNorm, SwiGLU's product and a residual add at (T, d) / (T, f): the bytes
                    step_time.memory_bound_bytes counts for them / time / those threads' copy bandwidth
    buffer_copy     a unit's tensors concatenated into a flat buffer and split back out, as FSDP copies them in
                    and out, and chunk-concatenated into the reduce dtype, as its reduce-scatter copies them in
                    (measure_buffer_copies): bytes / time / those threads' copy bandwidth
    optimizer       the trainer's gradient clipping and AdamW step (fused where torch has the kernel: CPU, CUDA)
                    over OPTIMIZER_ELEMENTS fp32 parameters: step_time.OPTIMIZER_BYTES_PER_ELEMENT a parameter /
                    time / those threads' copy bandwidth (the in-place update beats a copy: above 1 on a CPU)
    op_overhead_us  a chain of tiny autograd ops: time / aten operators dispatched (counted)
    dtensor_overhead_us  the model cut to one block, under tp on a one-rank mesh vs plain, over the DTensor
                    operators it ran (optimus/plan/dtensor_cost.py)
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import torch
import torch.nn.functional as F

from optimus.config import Config
from optimus.parallel.data_parallel import TORCH_DTYPES
from optimus.plan.dtensor_cost import measure_dtensor_overhead
from optimus.plan.efficiency import OPTIMIZER_MAX, Efficiency
from optimus.plan.step_time import OPTIMIZER_BYTES_PER_ELEMENT
from optimus.plan.timing import CountOps, best_time, device_seconds

# the optimizer's state for this many parameters (master, gradient, two moments: 128 MiB in fp32) is far past any
# last-level cache, as a model's is; its rate per byte was flat from 4 to 30 million on a 2-core EPYC
OPTIMIZER_ELEMENTS = 8 * 1024 * 1024
# on an accelerator the optimizer step and the buffer copies are timed over this many times the elements: at HBM's
# terabytes a second the host's elements pass in tens of microseconds, which the kernels' launches would dominate
# (a step updates and copies a model's hundreds of millions of elements, bandwidth bound)
ACCELERATOR_ELEMENTS_SCALE = 16


def _forward_backward(fn: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        out = fn(*inputs)
        out.backward(torch.ones_like(out))
    return run


def memory_bound_block(norm: torch.nn.Module) -> Callable[..., tuple[torch.Tensor, ...]]:
    """The memory-bound class's block: a norm, SwiGLU's product and a residual add, each output whole."""
    def block(a: torch.Tensor, g: torch.Tensor, u: torch.Tensor, r: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return norm(a), F.silu(g) * u, a + r
    return block


def memory_bound_call(block: Callable[..., tuple[torch.Tensor, ...]], inputs: tuple[torch.Tensor, ...],
                      writes_outputs: bool) -> Callable[[], None]:
    """One forward and backward of `block`. writes_outputs: its outputs written and a gradient of each read back,
    as a model's norms, SwiGLU and residuals do (the bytes step_time.memory_bound_bytes counts); else the outputs
    summed into one scalar, as the CPU calibrations that priced `here`'s layouts were timed. Summed, a compiled
    block skips those writes and reads, some 40% of the count: one H200 read it at 0.96-1.0 of HBM's bandwidth,
    over the ~0.9 a plain copy reaches there (2026-11-30)."""
    if not writes_outputs:
        def summed() -> None:
            a, b, c = block(*inputs)
            (a.sum() + b.sum() + c.sum()).backward()
        return summed
    grads = [torch.randn_like(out) for out in block(*inputs)]

    def whole() -> None:
        torch.autograd.backward(block(*inputs), grads)
    return whole


def measure_optimizer_step(elements: int = OPTIMIZER_ELEMENTS, device: torch.device | None = None) -> dict[str, float]:
    """Time the trainer's gradient clipping and AdamW step (optim/build.py's kernel choice) on this thread (or
    `device`) over `elements` fp32 parameters in a few tensors; the bytes are what step_time charges for them."""
    from optimus.optim.build import adamw_kernel
    from optimus.train.step import clip_gradients

    params = [torch.nn.Parameter(torch.randn(part, device=device) * 0.02) for part in [elements // 8] * 8]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    optimizer = torch.optim.AdamW(params, lr=1e-4, **adamw_kernel([{"params": params}]))

    def step() -> None:
        clip_gradients(params, 1.0)
        optimizer.step()
    return {"seconds": device_seconds(step, 3, device),
            "bytes": float(sum(p.numel() for p in params) * OPTIMIZER_BYTES_PER_ELEMENT)}


# calls each compute class is timed over, the fastest counting: on a shared host one slow call of two set a class's
# efficiency (plan_vs_measured's dense PP 2 GPipe row was predicted 1.61 s and 1.87 s twenty minutes apart, its loss
# head timed at 0.79 and 0.70 of peak)
COMPUTE_REPEATS = 4


def _random_input(dt: torch.dtype, device: torch.device | None, *shape: int) -> torch.Tensor:
    """A small-valued tensor that takes a gradient, as the timed blocks' inputs and weights."""
    return (torch.randn(*shape, device=device) * 0.02).to(dt).requires_grad_()


def _time_compute_classes(config: Config, dt: torch.dtype, device: torch.device | None) -> dict[str, dict]:
    """The compute classes (dense_gemm, grouped_gemm where the model has experts, attention, loss_head) timed at
    `config`'s shapes: {"seconds", "flops"} each (see the module)."""
    from optimus.ops import moe_experts_forward
    from optimus.ops.cross_entropy import linear_cross_entropy

    m, train = config.model, config.train
    tokens = (train.micro_batch_size or 1) * train.seq_len
    h, kv, f = m.d_model, m.kv_heads * m.head_dim, (m.ffn_hidden or 4 * m.d_model)
    on_host = device is None or device.type == "cpu"
    tensor = partial(_random_input, dt, device)

    def timed(fn: Callable[[], None]) -> float:
        return device_seconds(fn, COMPUTE_REPEATS, device)  # on an accelerator its kernels' time

    x = tensor(tokens, h)
    measured: dict[str, Any] = {}
    # dense: the block's projections (q, k, v, o, and the dense MLP's three when there is one) as one tp rank
    # holds them: column-parallel ones (q, k, v, gate, up) a 1/tp share of their outputs, row-parallel ones (o,
    # down) of their inputs, over all the micro-batch's tokens (sequence parallelism gathers them first)
    tp = config.parallel.tp
    shapes = ([(h, -(-h // tp)), (h, -(-kv // tp)), (h, -(-kv // tp)), (-(-h // tp), h)] +
              ([] if m.is_moe else [(h, -(-f // tp)), (h, -(-f // tp)), (-(-f // tp), h)]))
    flops = seconds = 0.0
    for fan_in, fan_out in shapes:
        inp = x if fan_in == h else tensor(tokens, fan_in)
        seconds += timed(_forward_backward(lambda a, w: a @ w, inp, tensor(fan_in, fan_out)))
        flops += 6.0 * tokens * fan_in * fan_out
    measured["dense_gemm"] = {"seconds": seconds, "flops": flops}
    if m.is_moe:
        # as one ep x tp rank computes them: its E / (ep tp) experts, each fed the copies the ep group routes to it
        # (ep T k / E rows), T k / tp copies in all; more rows per expert run faster (a 2-core EPYC's tiny MoE:
        # 49 GFLOP/s over all 16 experts, 59 over the 8 of an ep 2 rank)
        k, fe = m.top_k, m.expert_ffn_hidden
        experts = max(1, m.n_experts // (config.parallel.ep * tp))
        picks = min(k, experts)
        routed = max(1, -(-tokens * k // (tp * picks)))  # tokens whose `picks` copies make this rank's T k / tp
        ids = torch.stack([torch.randperm(experts)[:picks] for _ in range(routed)]).to(device)
        weights = torch.softmax(torch.randn(routed, picks, device=device), dim=-1).to(dt)
        run = _forward_backward(lambda a, wgu, wd: moe_experts_forward(a, ids, weights, wgu, wd), tensor(routed, h),
                                tensor(experts, h, 2 * fe), tensor(experts, fe, h))
        measured["grouped_gemm"] = {"seconds": timed(run), "flops": 18.0 * routed * picks * h * fe,
                                    "experts": experts}
    heads, seq = max(1, m.n_heads // tp), train.seq_len  # a tp rank's heads
    batch = max(1, tokens // seq)
    q = tensor(batch, heads, seq, m.head_dim)
    kk, vv = tensor(batch, heads, seq, m.head_dim), tensor(batch, heads, seq, m.head_dim)
    run = _forward_backward(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, kk, vv)
    measured["attention"] = {"seconds": timed(run),
                             "flops": 12.0 * tokens * heads * m.head_dim * seq}
    # the loss head over a tp rank's share of the vocabulary (optimus/parallel/vocab_parallel.py): the CPU's chunked
    # kernel keeps one rate per row past a chunk; an accelerator's plain path (ops/cross_entropy.py) runs all rows
    rows, vocab = (min(tokens, 1024) if on_host else tokens), -(-m.vocab_size // tp)
    labels = torch.randint(0, vocab, (rows,), device=device)
    run = _forward_backward(lambda a, w: linear_cross_entropy(a, w, labels), tensor(rows, h), tensor(vocab, h))
    measured["loss_head"] = {"seconds": timed(run), "flops": 6.0 * rows * h * vocab}
    return measured


def compute_class_rates(config: Config, dtype: str, peak_flops: float,
                        device: torch.device | None = None) -> dict[str, float]:
    """The compute classes' fractions of `peak_flops` at `config`'s shapes (one point of calibrate_node's by_rows
    table)."""
    measured = _time_compute_classes(config, TORCH_DTYPES[dtype], device)
    return {name: min(1.0, t["flops"] / t["seconds"] / peak_flops) for name, t in measured.items()}


def measure_op_classes(config: Config, dtype: str, peak_flops: float, copy_bytes_s: float,
                       device: torch.device | None = None, time_dtensor: bool = True) -> dict[str, Any]:
    """Time each op class at `config`'s shapes (on this process's threads, against the peak and copy bandwidth
    they have; or on an accelerator `device`, against its datasheet peak and HBM bandwidth: calibrate_node.py);
    return each class's efficiency and what it timed. `time_dtensor` False: no DTensor overhead (an accelerator's
    host dispatches it ahead of the device: the GPU presets' 0)."""
    m, train = config.model, config.train
    dt = TORCH_DTYPES[dtype]
    width = 2 if dtype == "bf16" else 4
    tokens = (train.micro_batch_size or 1) * train.seq_len
    h, f = m.d_model, (m.ffn_hidden or 4 * m.d_model)
    on_host = device is None or device.type == "cpu"
    tensor = partial(_random_input, dt, device)

    measured = _time_compute_classes(config, dt, device)
    # memory bound: a norm, a SwiGLU product and a residual add
    from optimus.models.layers import RMSNorm

    norm = RMSNorm(h).to(device=device, dtype=dt)
    x, gate, up, res = tensor(tokens, h), tensor(tokens, f), tensor(tokens, f), tensor(tokens, h)
    block = memory_bound_call(memory_bound_block(norm), (x, gate, up, res), writes_outputs=not on_host)
    # tens of milliseconds: more repeats, or one slow call (another process on the core) sets the efficiency
    measured["memory_bound"] = {"seconds": device_seconds(block, 6, device),
                                "bytes": tokens * (2 * h + 3 * f + 3 * h) * width * 3}
    scale = 1 if on_host else ACCELERATOR_ELEMENTS_SCALE
    measured["optimizer"] = measure_optimizer_step(OPTIMIZER_ELEMENTS * scale, device)
    measured["buffer_copy"] = measure_buffer_copies(
        dt, torch.bfloat16 if config.parallel.grad_reduce_dtype == "bf16" else torch.float32, device, scale)
    # fixed cost per operator: a chain of tiny autograd ops, timed and counted
    tiny = torch.ones(8, requires_grad=True, device=device)

    def chain() -> None:
        y = tiny
        for _ in range(100):
            y = y * 1.0001 + 0.0
        y.sum().backward()

    with CountOps() as counter:
        chain()
    # the host's time, to the end of the device's work (what runs of small kernels leave the device idle for)
    measured["op_overhead"] = {"seconds": best_time(chain, 5, device), "operators": counter.count}
    # what tp's DTensors add per operator: one block under tp on a one-rank mesh vs plain (a forked rank)
    measured["dtensor_overhead"] = (measure_dtensor_overhead(config, dtype) if time_dtensor else
                                    {"us_per_operator": 0.0, "not timed": "the host dispatches ahead of the device"})

    def rate(name: str) -> float:
        return min(1.0, measured[name]["flops"] / measured[name]["seconds"] / peak_flops)

    efficiency = Efficiency(
        dense_gemm=rate("dense_gemm"), grouped_gemm=rate("grouped_gemm") if m.is_moe else rate("dense_gemm"),
        attention=rate("attention"), loss_head=rate("loss_head"),
        memory_bound=min(1.0, measured["memory_bound"]["bytes"] / measured["memory_bound"]["seconds"] / copy_bytes_s),
        optimizer=min(OPTIMIZER_MAX, measured["optimizer"]["bytes"] / measured["optimizer"]["seconds"] / copy_bytes_s),
        buffer_copy=min(OPTIMIZER_MAX,
                        measured["buffer_copy"]["bytes"] / measured["buffer_copy"]["seconds"] / copy_bytes_s),
        op_overhead_us=1e6 * measured["op_overhead"]["seconds"] / measured["op_overhead"]["operators"],
        dtensor_overhead_us=measured["dtensor_overhead"]["us_per_operator"])
    return {"efficiency": efficiency.to_dict(), "timed": measured}


BUFFER_COPY_ELEMENTS = (8 * 1024 * 1024, 4 * 1024 * 1024, 2 * 1024 * 1024, 1024 * 1024, 1024 * 1024)


def measure_buffer_copies(dtype: torch.dtype, reduce_dtype: torch.dtype, device: torch.device | None = None,
                          scale: int = 1) -> dict[str, float]:
    """Data parallelism's copies as FSDP makes them (optim/sharded.py's packing is the same kind), over 16 M elements
    (times `scale`) in `dtype` (past the last-level cache, as a model's larger units are): a unit's tensors
    concatenated into one flat buffer and split back out (its all-gather's copy-in and copy-out: torch.cat,
    torch.split_with_sizes_copy), and chunk-concatenated into a `reduce_dtype` buffer (its reduce-scatter's
    copy-in: torch._chunk_cat, which casts slower than a plain copy does: 0.56 of a copy's bandwidth from fp32 to
    bf16 on a 2-core EPYC, 0.94 without the cast); a read and a write per element each."""
    sizes = [n * scale for n in BUFFER_COPY_ELEMENTS]
    tensors = [torch.randn(n, device=device).to(dtype) for n in sizes]
    elements = sum(sizes)
    flat = torch.empty(elements, dtype=dtype, device=device)
    reduce_input = torch.empty(2, elements // 2, dtype=reduce_dtype, device=device)
    back = [torch.empty_like(t) for t in tensors]

    def copies() -> None:
        torch.cat(tensors, out=flat)
        torch.split_with_sizes_copy(flat, sizes, out=back)
        torch._chunk_cat(tensors, 0, 2, out=reduce_input)
    width, reduce_width = flat.element_size(), reduce_input.element_size()
    return {"seconds": device_seconds(copies, COMPUTE_REPEATS, device),
            "bytes": elements * (4 * width + width + reduce_width)}


def calibrate_op_classes(config: Config, entry: dict[str, Any], threads: int = 1) -> dict[str, Any]:
    """Measure the op classes for `config` on `threads` threads (a rank's, here.rank_threads) against this host's
    machine entry (see here.machine); returns {"efficiency", "timed", "calibrated_threads", "machine" (the
    entry's, with the peak raised when a fresh probe beats it)}. The efficiencies are fractions of the rates
    here.here_cluster gives a rank of that many threads (here.thread_rate, here.thread_bandwidth)."""
    from optimus.plan.here import rate_probe, thread_bandwidth, thread_rate
    from optimus.train.hardware import best_matmul_rate
    from optimus.train.host_memory import reuse_freed_host_memory

    reuse_freed_host_memory()  # time the ops with the allocator a training process has
    m = dict(entry["machine"])
    dtype = m["auto_dtype"] if config.train.dtype == "auto" else config.train.dtype
    threads = max(1, min(threads, m["cores"]))
    key, probed_on = rate_probe(m, dtype, threads)  # the probe a rank of this many threads is priced from
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # the peak again, beside the op classes (one probed while the cores were busier would read them above 1),
        # where this many threads is what that probe ran on
        if (dtype == "fp32" or m["bf16_flops_per_thread"] >= m["fp32_flops_per_thread"]) and threads == probed_on:
            m[key] = max(m[key], best_matmul_rate(torch.float32 if dtype == "fp32" else torch.bfloat16, 1024, 0.3))
        measured = measure_op_classes(config, dtype, thread_rate(m, dtype, threads), thread_bandwidth(m, threads))
        return {**measured, "calibrated_threads": threads, "machine": m}
    finally:
        torch.set_num_threads(before)


def describe(entry: dict[str, Any]) -> list[str]:
    """What was measured, as lines to print."""
    from optimus.plan.here import threads_phrase

    m = entry["machine"]
    load = m.get("load_at_measure")
    lines = [f"here: {m['cpu']}, {m['cores']} cores, {m['memory_bytes'] / 1024**3:.1f} GiB, measured {m['measured_at']}"
             + (f" at load {load:.1f}" if load is not None else ""),
             f"  matmul peak per thread: fp32 {m['fp32_flops_per_thread'] / 1e9:.1f} GFLOP/s, "
             f"bf16 {m['bf16_flops_per_thread'] / 1e9:.1f} GFLOP/s (train.dtype auto -> {m['auto_dtype']})",
             f"  copy bandwidth: {m['copy_gb_s_one_thread']:.1f} GB/s one thread, {m['copy_gb_s_all_cores']:.1f} GB/s all cores"]
    if "fp32_flops_all_cores" in m:
        lines.insert(2, f"  matmul peak, all {m['cores']} cores: fp32 {m['fp32_flops_all_cores'] / 1e9:.1f} GFLOP/s, "
                        f"bf16 {m['bf16_flops_all_cores'] / 1e9:.1f} GFLOP/s")
    for world, fit in sorted(m["collectives"]["fits"].items()):
        lines.append(f"  gloo loopback, {world} ranks: alpha {fit['alpha_us']:.0f} us, beta {fit['beta_gb_s']:.2f} GB/s "
                     f"(worst fit error {fit['worst_relative_error']:.0%})")
    for world, points in sorted(m["collectives"].get("sync_after_compute", {}).items()):
        after = ", ".join(f"{extra * 1e3:.2f} ms after {chunk * 1e3:.0f} ms" for chunk, extra in points)
        lines.append(f"  a collective reached after compute, {world} ranks: {after} of compute, beyond the table")
    if "efficiency" in entry:
        e, timed = entry["efficiency"], entry.get("timed", {})
        threads = entry.get("calibrated_threads", 1)
        lines.append(f"  op classes at {entry.get('calibrated_for', '?')} ({threads_phrase(threads)}):")
        for name in ("dense_gemm", "grouped_gemm", "attention", "loss_head", "memory_bound", "optimizer",
                     "buffer_copy"):
            took = timed.get(name, {}).get("seconds")
            if name not in e:  # a calibration from before the optimizer step was timed
                continue
            bandwidth_bound = name in ("memory_bound", "optimizer", "buffer_copy")
            of = f"of the copy bandwidth on {threads_phrase(threads)}" if bandwidth_bound else "of peak"
            lines.append(f"    {name:<13} {e[name]:.2f} {of}" + (f" ({took * 1e3:.1f} ms timed)" if took else
                                                                 " (no experts: as dense_gemm)"))
        lines.append(f"    op_overhead   {e['op_overhead_us']:.1f} us per operator")
        lines.append(f"    dtensor       {e.get('dtensor_overhead_us', 0.0):.1f} us more per DTensor operator (under tp)")
    return lines
