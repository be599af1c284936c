"""Where a training step's time goes on a GPU, by op class, beside what the planner charges each class.

    python benchmarks/step_profile.py [--cluster h100|h200] [--only CASE,...] [--steps 2] [--warmup 3]
        [--json bench-results/gpu/step_profile.json]

The cases are benchmarks/plan_gpu.py's (Mula shapes on one GPU). Each trains in this process as `optimus train`
does, under torch.profiler for `--steps` steps after the warm-up, and sorts every GPU kernel of those steps into
the planner's op classes by its name:
  dense_gemm    cuBLAS / CUTLASS matrix products (nvjet, xmma, gemm, cutlass kernels not grouped)
  grouped_gemm  the experts' grouped products (torch._grouped_mm's grouped CUTLASS kernels, our Triton ones)
  attention     flash / memory-efficient attention, forward and backward
  optimizer     AdamW and the clipping norm (multi-tensor / foreach kernels)
  memory_bound  everything else: elementwise, reductions, norms, softmax/loss, permutes, copies
and reports per step: each class's kernel seconds, the rate it reached (the class's FLOPs as the planner counts
them, over its seconds, over the preset's peak; bytes over HBM bandwidth for memory_bound), the preset's
efficiency for that class, and the GPU's idle time (the step's wall time the union of kernels leaves
uncovered: launches and Python the GPU waits for). So a miss of plan_gpu.py's step time reads as: which class
ran below its preset's efficiency, and how much of the step the GPU sat idle. Where the idle time goes on the
host: the GPU's idle time within each phase of the step (train/step.py names forward_backward, clip_gradients
and optimizer_step for profilers; the rest is data, callbacks and logging), the host events (aten operators, CUDA
runtime calls, autograd and checkpoint frames) with the most self time per step, how many operators and
kernel launches a step ran, and the idle gaps between kernels by length and by the kernels on either side (many
launch-sized gaps through runs of small kernels, or a few long stalls: what the eager steps' idle still leaves open).
"""

from __future__ import annotations

import re
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from optimus.plan.timing import device_kernels  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import machine_info, write_json  # noqa: E402
from benchmarks.plan_gpu import add_case_arguments, case_overrides, priced_trainer, selected_cases  # noqa: E402
from optimus.config import load_config  # noqa: E402
from optimus.train.callbacks.base import Callback  # noqa: E402

# first match wins: grouped before dense (grouped CUTLASS kernels are gemms too)
KERNEL_CLASSES = (
    ("grouped_gemm", re.compile(r"grouped|GroupProblem|_grouped_rows|_grouped_wgrad", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("dense_gemm", re.compile(r"nvjet|xmma|gemm|cutlass|cublas", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
)


def kernel_class(name: str) -> str:
    for label, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return label
    return "memory_bound"


class _StepProfiler(Callback):
    """Advances the profiler's schedule once per training step."""

    def __init__(self, profiler):
        self.profiler = profiler

    def after_step(self, step: int) -> None:
        torch.cuda.synchronize()
        self.profiler.step()


def _union(intervals: list[tuple[float, float]]) -> float:
    covered, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    return covered


def idle_by_phase(phases: list[tuple[str, float, float]], kernels: list[tuple[float, float]], steps: int) -> dict:
    """Per step and phase (train/step.py's record_function spans: name, start, end in us): how long the host spent
    in it and how much of that the GPU ran no kernel (kernels as (start, end) intervals, us)."""
    out: dict[str, dict[str, float]] = {}
    for name, start, end in phases:
        busy = _union([(max(a, start), min(b, end)) for a, b in kernels if b > start and a < end])
        phase = out.setdefault(name, {"host_s": 0.0, "gpu_idle_s": 0.0})
        phase["host_s"] += (end - start) * 1e-6 / steps
        phase["gpu_idle_s"] += (end - start - busy) * 1e-6 / steps
    return out


# how long the GPU waits between two kernels, in us: under launch-bound runs of small kernels the gaps are a few to a
# few tens of microseconds each; a host stall (a sync, the allocator, Python between phases) leaves a long one
GAP_BUCKETS_US = (5.0, 20.0, 100.0, 1000.0)


def _bucket(gap_us: float) -> str:
    low = 0.0
    for high in GAP_BUCKETS_US:
        if gap_us < high:
            return f"{low:g}-{high:g} us"
        low = high
    return f">= {low:g} us"


def idle_gaps(kernels: list[tuple[str, float, float]], steps: int, top: int = 15) -> dict:
    """Per step: the GPU's idle gaps between kernels (name, start, end in us) by length (count and seconds in each
    GAP_BUCKETS_US range) and the kernel pairs (the last to finish before a gap -> the first after it) whose gaps
    add up to the most: whether the eager idle is many launch-sized gaps through stretches of small kernels, or a
    few long stalls, and where in the model."""
    buckets = {_bucket(b): {"count": 0.0, "s": 0.0} for b in (0.0, *GAP_BUCKETS_US)}
    pairs: dict[str, float] = {}
    last_name, covered_to = None, None
    for name, start, end in sorted(kernels, key=lambda k: k[1]):
        if covered_to is not None and start > covered_to:
            gap = start - covered_to
            bucket = buckets[_bucket(gap)]
            bucket["count"] += 1 / steps
            bucket["s"] += gap * 1e-6 / steps
            key = f"{last_name[:60]} -> {name[:60]}"
            pairs[key] = pairs.get(key, 0.0) + gap * 1e-6 / steps
        if covered_to is None or end > covered_to:
            last_name, covered_to = name, end
    return {"by_length": buckets, "top_pairs_s": dict(sorted(pairs.items(), key=lambda kv: -kv[1])[:top])}


def host_summary(events, steps: int, top: int = 25) -> dict:
    """Per step: the host events with the most self time (seconds, by name), the aten operators run and the
    kernels launched."""
    self_s: dict[str, float] = {}
    operators = launches = 0
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU or event.name.startswith("ProfilerStep"):
            continue
        self_s[event.name] = self_s.get(event.name, 0.0) + event.self_cpu_time_total * 1e-6 / steps
        operators += event.name.startswith("aten::")
        launches += event.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")
    return {"top_host_s": dict(sorted(self_s.items(), key=lambda kv: -kv[1])[:top]),
            "aten_ops_per_step": operators / steps, "launches_per_step": launches / steps}


def profile_case(name: str, cluster_name: str, steps: int, warmup: int, more: list[str] = ()) -> dict:
    from torch.profiler import ProfilerActivity, profile, schedule

    from optimus.parallel.validate import validate_layout
    from optimus.plan.cluster import load_cluster
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import _flops_by_class, _recomputed_flops, memory_bound_bytes, step_time

    config_path, overrides = case_overrides(name, steps, warmup, more)
    layout = validate_layout(load_config(config_path, overrides), 1)
    cluster = load_cluster(cluster_name)
    config = cluster.resolved(layout.config)
    shape = ModelShape.of(config)
    predicted = step_time(config, layout.dims, shape, cluster, None, layout.batch.micro_batches)
    tokens = config.train.global_batch_size * config.train.seq_len
    by_class = _flops_by_class(config, shape)
    recomputed = _recomputed_flops(config, by_class)
    flops = {c: tokens * (by_class[c] + recomputed.get(c, 0.0)) for c in by_class}
    class_flops = {"dense_gemm": flops["attention_proj"] + flops["mlp"] + flops["head"],
                   "grouped_gemm": flops["experts"], "attention": flops["attention"]}
    hbm_bytes = layout.batch.micro_batches * memory_bound_bytes(
        config, layout.dims, shape.n_layers, config.train.activation_checkpointing != "none")
    peak = cluster.peak_flops("bf16" if config.train.dtype != "fp32" else "fp32")

    with tempfile.TemporaryDirectory(prefix="optimus-step-profile-") as tmp:
        trainer = priced_trainer(config_path, overrides, f"{tmp}/run")
        profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                           schedule=schedule(wait=warmup - 1, warmup=1, active=steps))
        trainer.callbacks.append(_StepProfiler(profiler))
        with profiler:
            trainer.fit()
        del trainer
    events = profiler.events() or []
    kernels = device_kernels(events, torch.autograd.DeviceType.CUDA)  # the timeline's annotations left out
    seconds: dict[str, float] = {}  # per op class
    top: dict[str, float] = {}  # per kernel name
    for kernel in kernels:
        per_step = kernel.time_range.elapsed_us() * 1e-6 / steps
        label = kernel_class(kernel.name)
        seconds[label] = seconds.get(label, 0.0) + per_step
        top[kernel.name] = top.get(kernel.name, 0.0) + per_step
    # the host's step spans (each ends at the callback's synchronize): the GPU timeline's copies of the annotation
    # came back cut short once train/step.py annotated its phases too (one H100, 2026-11-26: half the step)
    step_spans = [e for e in events
                  if e.name.startswith("ProfilerStep") and e.device_type == torch.autograd.DeviceType.CPU]
    wall = statistics.median(e.time_range.elapsed_us() for e in step_spans) * 1e-6 if step_spans else float("nan")
    busy = _union([(k.time_range.start, k.time_range.end) for k in kernels]) * 1e-6 / steps
    rates = {c: class_flops[c] / seconds[c] / peak for c in class_flops if seconds.get(c)}
    if seconds.get("memory_bound"):
        rates["memory_bound"] = hbm_bytes / seconds["memory_bound"] / (cluster.hbm_gb_s * 1e9)
    host = host_summary(events, steps)
    phases = [(e.name, e.time_range.start, e.time_range.end) for e in events
              if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("optimus.")]
    by_phase = idle_by_phase(phases, [(k.time_range.start, k.time_range.end) for k in kernels], steps)
    gaps = idle_gaps([(k.name, k.time_range.start, k.time_range.end) for k in kernels], steps)
    # the rest of the step: data, callbacks, logging, the loss's .item()
    by_phase["between phases"] = {"host_s": wall - sum(p["host_s"] for p in by_phase.values()),
                                  "gpu_idle_s": wall - busy - sum(p["gpu_idle_s"] for p in by_phase.values())}
    return {"case": name, "cluster": cluster_name, "wall_s": wall, "gpu_busy_s": busy, "gpu_idle_s": wall - busy,
            "class_s": seconds, "class_rate": rates, "class_flops": class_flops, "memory_bound_bytes": hbm_bytes,
            "preset_efficiency": cluster.efficiency.to_dict(), "predicted_step_s": predicted.step_s,
            "predicted_parts_s": predicted.parts,
            "top_kernels_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:25]), "idle_by_phase": by_phase,
            "idle_gaps": gaps, **host}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    add_case_arguments(parser, 2, "profiled steps after the warm-up", "bench-results/gpu/step_profile.json")
    args = parser.parse_args(argv)
    device_name, cluster, names = selected_cases(args, "step_profile")
    rows = []
    for name in names:
        try:
            row = profile_case(name, cluster, args.steps, max(1, args.warmup), args.override)
        except Exception as error:  # noqa: BLE001 - one failing case is reported, the others still run
            print(f"{name}: FAILED: {type(error).__name__}: {error}", flush=True)
            rows.append({"case": name, "error": f"{type(error).__name__}: {error}"})
            continue
        rows.append(row)
        print(f"\n{name}: step {row['wall_s']:.3f} s (planner {row['predicted_step_s']:.3f}), GPU busy "
              f"{row['gpu_busy_s']:.3f} s, idle {row['gpu_idle_s']:.3f} s")
        print(f"  {'class':<14} {'kernel s':>9} {'rate':>7} {'preset':>7}")
        for label in ("dense_gemm", "grouped_gemm", "attention", "memory_bound", "optimizer"):
            if label in row["class_s"]:
                rate = row["class_rate"].get(label)
                preset = row["preset_efficiency"].get(label)
                print(f"  {label:<14} {row['class_s'][label]:>9.4f} "
                      f"{(f'{rate:.3f}' if rate is not None else '-'):>7} {(f'{preset:.2f}' if preset else '-'):>7}")
        for kernel, secs in list(row["top_kernels_s"].items())[:12]:
            print(f"    {secs:8.4f} s  {kernel[:110]}")
        print("  GPU idle by step phase: " + ", ".join(f"{name} {p['gpu_idle_s']:.3f} of {p['host_s']:.3f} s"
                                                       for name, p in row["idle_by_phase"].items()))
        print("  GPU idle gaps by length, per step: " + ", ".join(
            f"{label} {b['count']:.0f} ({b['s']:.3f} s)" for label, b in row["idle_gaps"]["by_length"].items()))
        for pair, secs in list(row["idle_gaps"]["top_pairs_s"].items())[:8]:
            print(f"    {secs:8.4f} s idle  {pair[:110]}")
        print(f"  host, per step: {row['aten_ops_per_step']:.0f} aten operators, {row['launches_per_step']:.0f} "
              "kernel launches; most self time:")
        for event, secs in list(row["top_host_s"].items())[:12]:
            print(f"    {secs:8.4f} s  {event[:110]}")
        sys.stdout.flush()
    write_json(args.json, {"machine": machine_info(), "device": device_name, "rows": rows})
    print(f"wrote {args.json}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
