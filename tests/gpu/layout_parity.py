"""Every layout kind against one process, on this machine's accelerators and their collective library (NCCL on
CUDA): what tests/distributed proves on gloo, for the devices a run will use. benchmarks/gpu.sh runs it where a
machine has several GPUs; an HPC user can run it on a node before a job.

    torchrun --nproc-per-node N tests/gpu/layout_parity.py [--device cuda|cpu] [--only NAME,...] [--steps 3]
                                                           [--json F] [--layout-timeout 300]

N is 2, 4 or 8: the layouts of that many ranks run (LAYOUTS), each the tiny parity model of tests/helpers/parity
(fp32, real text) trained --steps steps as a parallel layout and, on rank 0's device, as one process; losses,
gradient norms and step-1 gradients compared within the parity tolerances tests/helpers/parity.py states (TF32
off: fp32 matmuls on a GPU are then within those of one another; layouts with gradients reduced in bf16 within
bf16's rounding of the sums, assert_bf16_reduction_parity). Prints one line per layout and a verdict; exits
non-zero when a layout departs from one process or fails. A layout every rank refuses is reported and the next
one runs. A rank failing alone mid-step prints its traceback at once (the others may then abort on a collective
mismatch, or wait in a collective that cannot finish); a stalled rank leaves the others waiting too: after
--layout-timeout seconds rank 0 reports the layout as hung, writes the verdicts so far and the job exits 3
(torchrun stops the other ranks), rather than waiting out the collective library's own 10-30 minute timeout.
--device cpu runs the same on gloo (the CI checks the script that way). Not a pytest module: the CPU's parity
tests are tests/distributed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# world size -> layout name -> (MoE model, parallel settings, other config sections)
LAYOUTS: dict[int, dict[str, tuple[bool, dict, dict]]] = {
    2: {
        "fsdp": (False, dict(dp_shard=2), {}),
        "zero1": (False, dict(dp_shard=2, shard_mode="zero1"), {}),
        "zero2": (False, dict(dp_shard=2, shard_mode="zero2"), {}),
        "ddp": (False, dict(dp_shard=2, shard_mode="ddp"), {}),
        "tp2": (False, dict(tp=2), {}),
        "pp2-1f1b": (True, dict(pp=2, pp_schedule="1f1b"), dict(model={"n_layers": 4})),
        "fsdp-ep2": (True, dict(dp_shard=2, ep=2), {}),
        "fsdp-ep2-allgather": (True, dict(dp_shard=2, ep=2, ep_dispatch="allgather"), {}),
        "zero2-ep2-selective": (True, dict(dp_shard=2, ep=2, shard_mode="zero2"),
                                dict(train={"activation_checkpointing": "selective", "recompute": ["moe"]})),
        # gradients reduced in bf16 (the Mula recipes' setting): checked to bf16's rounding of the sums
        "fsdp-bf16-reduce": (False, dict(dp_shard=2, grad_reduce_dtype="bf16"), {}),
        "zero1-ep2-bf16-reduce": (True, dict(dp_shard=2, ep=2, shard_mode="zero1", grad_reduce_dtype="bf16"), {}),
    },
    4: {
        "hsdp2x2": (False, dict(dp_replicate=2, dp_shard=2), {}),
        "fsdp2-tp2": (True, dict(dp_shard=2, tp=2), {}),
        "tp2-pp2": (False, dict(tp=2, pp=2, pp_schedule="1f1b"), dict(model={"n_layers": 4})),
        "fsdp2-ep2-pp2": (True, dict(dp_shard=2, ep=2, pp=2, pp_schedule="1f1b"), dict(model={"n_layers": 4})),
        "zero1-ep2-tp2": (True, dict(dp_shard=2, ep=2, tp=2, shard_mode="zero1", ep_dispatch="allgather"), {}),
        "zero2-ep4": (True, dict(dp_shard=4, ep=4, shard_mode="zero2"), {}),
        "hsdp2x2-bf16-reduce": (False, dict(dp_replicate=2, dp_shard=2, grad_reduce_dtype="bf16"),
                                dict(train={"micro_batch_size": 1})),
    },
    8: {
        "fsdp2-tp2-pp2": (True, dict(dp_shard=2, tp=2, pp=2, pp_schedule="1f1b"), dict(model={"n_layers": 4})),
        "hsdp2x2-ep2-pp2": (True, dict(dp_replicate=2, dp_shard=2, ep=2, pp=2, pp_schedule="gpipe"),
                            dict(model={"n_layers": 4}, train={"micro_batch_size": 1})),
        "fsdp8-ep8": (True, dict(dp_shard=8, ep=8), dict(train={"micro_batch_size": 1})),
        "interleaved-pp2-tp2-dp2": (False, dict(dp_shard=2, tp=2, pp=2, pp_schedule="interleaved_1f1b",
                                                pp_virtual_stages=2), dict(model={"n_layers": 4})),
    },
}


def _to_cpu(record):
    record.grads = {name: grad.detach().cpu() for name, grad in record.grads.items()}
    return record


def check(name: str, world: int, rank: int, device: str, steps: int) -> dict:
    """Train layout `name` on every rank; rank 0 also trains one process and compares. Returns rank 0's verdict."""
    import torch.distributed as dist

    from tests.helpers.parity import (assert_bf16_reduction_parity, assert_parity, merge_rank_records,
                                      run_parallel_rank, run_single_process, tiny_config)

    moe, parallel, sections = LAYOUTS[world][name]
    start = time.perf_counter()
    outcome, records, config = {"layout": name, "ranks": world, "parallel": parallel}, None, None
    try:
        config = tiny_config(moe=moe, parallel=parallel, **sections)
        record = _to_cpu(run_parallel_rank(rank, world, config, steps, device=device))
    except Exception:  # this rank failed: rank 0 reports it (the others too, where every rank refused the layout)
        record = traceback.format_exc()
        # said here too: where the other ranks went on into a collective, rank 0 never gathers this
        print(f"rank {rank}: layout {name} failed:\n{record}", file=sys.stderr, flush=True)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(record, gathered, dst=0)
    if rank == 0:
        failures = [r for r in gathered if isinstance(r, str)]
        if failures:
            outcome.update(ok=False, error=failures[0].strip().splitlines()[-1], traceback=failures[0])
        else:
            records = merge_rank_records(gathered)
            reference = _to_cpu(run_single_process(config, steps, device=device))
            try:
                compare = assert_bf16_reduction_parity if parallel.get("grad_reduce_dtype") == "bf16" else assert_parity
                compare(reference, records)
                outcome.update(ok=True)
            except AssertionError as err:
                outcome.update(ok=False, error=str(err).splitlines()[0])
            outcome["losses"], outcome["reference_losses"] = records.losses, reference.losses
        outcome["seconds"] = round(time.perf_counter() - start, 2)
    dist.barrier()
    return outcome


def _report(verdicts: list[dict], device: str, world: int, json_path: str | None) -> int:
    """Rank 0's summary line and JSON; 0 when every layout matched one process."""
    passed = sum(v["ok"] for v in verdicts)
    print(f"layout parity on {world} {device} ranks ({'NCCL' if device == 'cuda' else 'gloo'}): "
          f"{passed} of {len(verdicts)} layouts match one process", flush=True)
    if json_path:
        Path(json_path).write_text(json.dumps({"device": device, "world": world, "layouts": verdicts}, indent=1))
    return 0 if passed == len(verdicts) else 1


def _watchdog(rank: int, seconds: float, on_hang) -> threading.Timer:
    """A timer that calls on_hang and ends this process when a layout has not finished in `seconds` (rank 0 first:
    the other ranks wait ten seconds longer, so rank 0 is the one that reports)."""
    def hung():
        on_hang()
        os._exit(3)

    timer = threading.Timer(seconds + (0 if rank == 0 else 10), hung)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="default: cuda where there is one (NCCL), else cpu (gloo)")
    parser.add_argument("--only", default="", help="comma-separated layout names of this world size")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", default=None, help="write rank 0's verdicts here")
    parser.add_argument("--layout-timeout", type=float, default=300.0,
                        help="seconds one layout may take before the job is called hung (default 300)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    world, rank = int(os.environ.get("WORLD_SIZE", "0")), int(os.environ.get("RANK", "0"))
    if world not in LAYOUTS:
        parser.error(f"run under torchrun with --nproc-per-node 2, 4 or 8 (WORLD_SIZE is {world or 'unset'})")
    names = [n for n in args.only.split(",") if n] or list(LAYOUTS[world])
    unknown = [n for n in names if n not in LAYOUTS[world]]
    if unknown:
        parser.error(f"--only: no {world}-rank layout {unknown[0]!r}; choose from {', '.join(LAYOUTS[world])}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # fp32 means fp32: TF32 matmuls would put one process and a layout 1e-3 apart
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    verdicts = []
    try:
        for name in names:
            def hung(name=name):
                if rank == 0:
                    verdicts.append({"layout": name, "ranks": world, "parallel": LAYOUTS[world][name][1], "ok": False,
                                     "error": f"hung: not finished in {args.layout_timeout:g} s (a rank stalled, "
                                              f"or failed mid-step: its traceback is above)"})
                    print(f"{name:<26} {world} ranks on {device}: HUNG after {args.layout_timeout:g} s; stopping",
                          flush=True)
                    _report(verdicts, device, world, args.json)

            watchdog = _watchdog(rank, args.layout_timeout, hung)
            verdict = check(name, world, rank, device, args.steps)
            watchdog.cancel()
            if rank == 0:
                verdicts.append(verdict)
                within = " (to bf16's rounding)" if verdict["parallel"].get("grad_reduce_dtype") == "bf16" else ""
                status = f"matches one process{within}" if verdict["ok"] else f"DIFFERS or FAILED: {verdict['error']}"
                print(f"{name:<26} {world} ranks on {device}: {status} ({verdict['seconds']} s)", flush=True)
    finally:
        dist.destroy_process_group()
    return _report(verdicts, device, world, args.json) if rank == 0 else 0


if __name__ == "__main__":
    code = main()
    # the verdicts are printed and written: end here rather than in the interpreter's teardown, where a rank has
    # (rarely, under load, after destroy_process_group) aborted in torch's C++ destructors and failed a passed check
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
