"""Run the planner on the published cases (REFERENCE.md) and print predicted vs published; no per-case tuning.

    PYTHONPATH=. python benchmarks/plan_published.py [frontier|lumi|aurora]

Frontier (arXiv 2312.12705): GPT-shaped dense models; the shapes are the usual GPT-3-style ones (22B: 48 x 6144,
175B: 96 x 12288, 1T: 128 x 25600), sequence 2048; the global batch (2048 sequences) and the device counts
(22B on 256 GCDs, 175B on 1,024, 1T on 3,072) are our assumptions where the abstract does not say.
Our blocks are SwiGLU, so ffn_hidden = 8/3 d keeps GPT's 12 d^2 parameters per layer.
"""

from __future__ import annotations

import sys

from optimus.config import load_config
from optimus.plan.cluster import load_cluster
from optimus.plan.memory import ModelShape
from optimus.plan.search import plan
from optimus.plan.step_time import Efficiency

GPT = {"22B": (48, 6144, 48, 256), "175B": (96, 12288, 96, 1024), "1T": (128, 25600, 160, 3072)}
PUBLISHED_MFU = {"22B": 0.3838, "175B": 0.3614, "1T": 0.3196}


def gpt(layers: int, d: int, heads: int, batch: int = 2048):
    ffn = (8 * d // 3) // 64 * 64
    return load_config("configs/mula-tiny-dense.yaml", [
        f"--model.n_layers={layers}", f"--model.d_model={d}", f"--model.n_heads={heads}", f"--model.ffn_hidden={ffn}",
        "--model.n_experts=0", "--model.qk_norm=false", "--train.seq_len=2048", f"--train.global_batch_size={batch}",
        "--train.dtype=bf16"])


def frontier(efficiency: float | None = None) -> None:
    """With `efficiency`: one GEMM efficiency for the whole cluster (fitted on 22B), to test the trend on the others."""
    cluster = load_cluster("frontier")
    eff = Efficiency() if efficiency is None else Efficiency(efficiency, efficiency, efficiency)
    for name, (layers, d, heads, devices) in GPT.items():
        config = gpt(layers, d, heads)
        best = plan(config, cluster, devices, eff)[0]
        print(f"frontier (efficiency {eff.dense_gemm:.3f}) {name} on {devices} GCDs: params {ModelShape.of(config).total / 1e9:.1f}B, predicted MFU "
              f"{best.mfu:.1%} vs published {PUBLISHED_MFU[name]:.1%} ({best.mfu - PUBLISHED_MFU[name]:+.1%} points); "
              f"fits {best.fits}, {best.memory_bytes / 2**30:.1f} GiB, layout {best.layout()}", flush=True)


def lumi() -> None:
    cluster = load_cluster("lumi")
    config = gpt(80, 12288, 96)  # ~145B: the "140B" class
    total = ModelShape.of(config).total
    weights = 2 * total  # 16-bit weights only
    print(f"lumi 140B-class ({total / 1e9:.1f}B params): 16-bit weights {weights / 1e9:.0f} GB -> "
          f"{-(-weights // cluster.memory_bytes):.0f} GCDs of {cluster.memory_gb:g} GiB just to hold them "
          f"(published: at least 5)", flush=True)


def aurora() -> None:
    cluster = load_cluster("aurora")
    config = load_config("configs/mula-220b-a10b.yaml")
    candidates = [c for c in plan(config, cluster, 3072) if c.fits]
    best = candidates[0]
    for rank, c in enumerate(candidates, 1):
        p = c.config.parallel
        if (p.ep, p.pp, p.tp) == (12, 8, 1):
            print(f"aurora 220B-A10B on 3,072 tiles: best predicted {best.layout()} {best.step_s:.3f} s, MFU "
                  f"{best.mfu:.1%}; first EP 12 x PP 8 at rank {rank}: {c.layout()} {c.step_s:.3f} s "
                  f"({c.step_s / best.step_s - 1:+.1%}), MFU {c.mfu:.1%}", flush=True)
            break


def aurora_scaling() -> None:
    """Strong scaling of 220B-A10B, global batch 3,072 fixed: the best layout at 384 and at 12,288 tiles."""
    cluster = load_cluster("aurora")
    config = load_config("configs/mula-220b-a10b.yaml")
    best = {n: next(c for c in plan(config, cluster, n) if c.fits) for n in (384, 12288)}
    eff = best[384].step_s * 384 / (best[12288].step_s * 12288)
    print(f"aurora 220B-A10B strong scaling 384 -> 12,288 tiles: {best[384].step_s:.3f} s -> {best[12288].step_s:.3f} s, "
          f"efficiency {eff:.1%} (published ~90%); layouts {best[384].layout()} / {best[12288].layout()}", flush=True)


if __name__ == "__main__":
    for which in sys.argv[1:] or ["lumi", "frontier", "aurora"]:
        name, _, value = which.partition("=")  # frontier=0.40: one cluster-wide GEMM efficiency
        globals()[name](*([float(value)] if value else []))
