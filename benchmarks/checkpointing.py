"""Op-level checkpointing (`selective_ops`) keeping its collectives' outputs vs replaying them, in the same ranks.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/checkpointing.py [--rounds 6] [--only moe-tp2,...]
        [--model=--model.n_layers=2,...] [--json F]

For each layout (2 gloo ranks; the tiny MoE under EP 2 with either dispatch and under TP 2, the tiny dense model
under TP 2) every rank builds the model twice from one seed, in each order in turn (one run each): with the
trainer's policy (parallelize._kept_ops: the outputs of matmuls, attention, the expert GEMMs and every collective
but the all-gathers are kept) and with the reference, the policy before it (the same minus the collectives: the
recompute ran each of them again). Forward and backward of one micro-batch alternate between the two, round by
round; the table gives the median of each (the slowest rank's, averaged over the two runs), the speedup as the
geometric mean of the two runs' ratios, the collectives' calls and bytes in the backward (torch.distributed's,
counted by wrapping them: FSDP's, the EP exchanges, the experts' tp gathers; DTensor's own sequence-parallel
collectives do not pass there), and checks that both give the same gradients.
"""

from __future__ import annotations

import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402

from benchmarks._common import CollectiveCounter, machine_info, time_interleaved, write_json  # noqa: E402
from optimus.parallel.parallelize import _kept_collectives, _kept_ops  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--train.dtype=fp32", "--train.seq_len=128", "--train.global_batch_size=8",
        "--train.activation_checkpointing=selective_ops"]
LAYOUTS = {
    "moe-ep2-all_to_all": ("configs/mula-tiny-moe.yaml", ["--parallel.dp_shard=2", "--parallel.ep=2"]),
    "moe-ep2-allgather": ("configs/mula-tiny-moe.yaml", ["--parallel.dp_shard=2", "--parallel.ep=2",
                                                         "--parallel.ep_dispatch=allgather"]),
    "moe-tp2": ("configs/mula-tiny-moe.yaml", ["--parallel.tp=2"]),
    "dense-tp2": ("configs/mula-tiny-dense.yaml", ["--parallel.tp=2"]),
}


def _replaying_policy(ctx, op, *args, **kwargs):
    """The reference: keep what the trainer keeps but the collectives (the policy before they were kept). Called for
    every op, as the trainer's is: its sets are built once."""
    kept = op in _kept_ops() and op not in _kept_collectives()
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def _rank(rank: int, world: int, config_path: str, overrides: list[str], rounds: int, first: str) -> dict:
    import torch

    import optimus.parallel.parallelize as parallelize
    from optimus.config import load_config
    from optimus.parallel.mesh import ParallelDims

    config = load_config(config_path, overrides)
    dims = ParallelDims.from_config(config.parallel, world)
    mesh = dims.build_mesh("cpu")
    trainer_policy, models = parallelize._ops_policy, {}
    for name in (("kept", "replayed") if first == "kept" else ("replayed", "kept")):
        parallelize._ops_policy = trainer_policy if name == "kept" else _replaying_policy
        try:
            models[name] = parallelize.build_parallel_model(config, dims, mesh, "cpu")
        finally:
            parallelize._ops_policy = trainer_policy
    generator = torch.Generator().manual_seed(0)
    per_rank = config.train.global_batch_size // mesh.size("dp")
    ids = torch.randint(0, config.model.vocab_size, (config.train.global_batch_size, config.train.seq_len + 1),
                        generator=generator)
    rows = ids[mesh.local_rank("dp") * per_rank:(mesh.local_rank("dp") + 1) * per_rank]

    def step(model):
        model.zero_grad(set_to_none=True)
        model(rows[:, :-1], labels=rows[:, 1:]).loss.backward()

    # alternating round by round (and the order within a round), one warm-up call each
    times = time_interleaved({name: functools.partial(step, model) for name, model in models.items()}, rounds, 1)
    counter = CollectiveCounter()
    counter.install()
    counted: dict[str, dict] = {}
    for name, model in models.items():  # one more step each, its backward's collectives counted
        model.zero_grad(set_to_none=True)
        loss = model(rows[:, :-1], labels=rows[:, 1:]).loss
        counter.bytes.clear(), counter.calls.clear()
        counter.active = True
        loss.backward()
        counter.active = False
        counted[name] = {"calls": dict(counter.calls), "bytes": dict(counter.bytes)}
    grads = {name: {n: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                    for n, p in model.named_parameters() if p.grad is not None} for name, model in models.items()}
    max_diff = max(float((grads["kept"][n] - grads["replayed"][n]).abs().max()) for n in grads["kept"])
    return {"rank": rank, "median_s": {n: t["median"] for n, t in times.items()},
            "backward_collectives": counted, "grad_max_abs_diff": max_diff}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds per layout (each runs both policies)")
    parser.add_argument("--only", default=None, help="comma-separated layout names (default: all)")
    parser.add_argument("--model", default="", help="extra --model.* overrides for every layout, comma-separated "
                                                    "(a smaller model for a quick check)")
    parser.add_argument("--json", default="benchmarks/results/checkpointing.json")
    args = parser.parse_args(argv)
    names, model = (args.only.split(",") if args.only else list(LAYOUTS)), [m for m in args.model.split(",") if m]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layout {unknown[0]}: choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    rows = []
    print("| layout | kept s | replayed s | speedup (kept built first / second) | backward collective calls kept / "
          "replayed | bytes kept / replayed | max grad diff |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        config_path, extra = LAYOUTS[name]
        # each order of building the two models once: the model built first ran up to 4% faster with the same
        # policy on both (the allocator's state), so the speedup is the geometric mean of the two orders'
        runs = {first: run_distributed(_rank, 2, str(ROOT / config_path), [*BASE, *model, *extra], args.rounds, first,
                                       timeout=900.0) for first in ("kept", "replayed")}
        slowest = {first: {p: max(r["median_s"][p] for r in out) for p in ("kept", "replayed")}
                   for first, out in runs.items()}
        ratios = [s["replayed"] / s["kept"] for s in slowest.values()]
        speedup = (ratios[0] * ratios[1]) ** 0.5
        first = runs["kept"][0]["backward_collectives"]
        calls = {p: sum(first[p]["calls"].values()) for p in first}
        moved = {p: sum(first[p]["bytes"].values()) for p in first}
        diff = max(r["grad_max_abs_diff"] for out in runs.values() for r in out)
        rows.append({"layout": name, "overrides": extra, "step_s_by_first_built": slowest, "speedup": speedup,
                     "backward_collectives": first, "grad_max_abs_diff": diff})
        kept_s, replayed_s = (statistics.mean(s[p] for s in slowest.values()) for p in ("kept", "replayed"))
        print(f"| {name} | {kept_s:.3f} | {replayed_s:.3f} | {speedup:.2f}x ({ratios[0]:.2f} / {ratios[1]:.2f}) | "
              f"{calls['kept']} / {calls['replayed']} | {moved['kept']:,} / {moved['replayed']:,} | {diff:.1e} |",
              flush=True)
    write_json(args.json, {"machine": machine_info(), "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
