"""The planner's calibrated prediction for this machine vs short real trainings here, layout by layout.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/plan_vs_measured.py [--json benchmarks/results/plan_vs_measured.json]
        [--steps 4] [--warmup 2] [--repeats 2] [--memory-runs N] [--only NAME,...|smoke] [--no-calibrate]
        [--row-tables] [--model=--model.n_layers=2,...]

For each layout (1-4 gloo ranks; dense and MoE tiny models; FSDP, HSDP, DDP, zero1/2, TP, PP (1F1B, interleaved), EP,
expert-tensor parallelism, activation checkpointing, one or several micro-batches a step: the kinds of layout
tests/distributed trains, read test by test at stop 40 (BENCHMARKS.md), those combining kinds already here aside;
a lone rank on every core, as `optimus train` alone runs; bf16 compute, where the CPU has it natively) it runs the
Trainer, the same code path as `optimus train` (forked ranks joined by gloo, one thread each, as torchrun gives
them, or every core's for the ALL_CORES rows), for warm-up + measured steps, reads each step's time from its
metrics.jsonl (global tokens per step / tokens_per_s, logged every step), takes the median step of each of
`--repeats` runs and the fastest of those medians (on a shared machine a run slowed by other work says nothing
about the layout: the same layout measured 2.16 s and 2.73 s six minutes apart), and compares it with
`step_time` for the `here` cluster of that many ranks (from `optimus plan --calibrate`'s cache, measured first
when there is none; the op classes timed at the layout's shapes before its runs and after them, the mean of the
two predictions counting: a calibration moves by up to 18% minutes apart on a shared host; where the two differ
by more than 15%, a third is taken and the one apart from the other two dropped), and each rank's
memory with the planner's stage_memory of the first and last stage. The planner assumes balanced routing; where ep or tp split an MoE's experts, each row also gives the busiest rank's
share of the run's token copies (routing_imbalance, from its logged expert counts) and the memory model at it, and
the share each layer's busiest rank had in the timed run (paced_routing_imbalance: what its expert GEMMs waited
for) and the step time at it.

`--row-tables` times the gloo collectives of each multi-rank row's job size (the whole job, its pairs where it has
four ranks, the sync after compute: 15-55 s) just before its runs and prices the row on them instead of the cached
table: two tables timed minutes apart on a shared host differ by 18% a row (BENCHMARKS.md, stop 48), so a row priced
on a table from another hour reads that table's draw as well as the model's error. The row keeps its table
(`collectives`), which plan_here_stored.py `--add` stores with it.

`--repeats 0` measures memory alone (no step time compared), e.g. at a longer sequence: `--repeats 0
--no-calibrate --model=--train.seq_len=2048`.

Memory measured: the allocator's peak, as max_memory_allocated reads it on a GPU: in `--memory-runs` further
runs (each rank's least over them; by default two where there are several ranks, one for a lone rank: a reading
only errs high, and in one run of the 45 rows one rank read 8-18% high in five, which the least of two read
within 3%: BENCHMARKS.md, stop 37), each rank trains under torch.profiler with profile_memory (started before the
Trainer is built), and the most bytes live at once is rebuilt from its allocation and free events, block by block
(allocator_peak: the events' own running total climbs past the truth when other threads free tensors); the largest
rank's. The timed runs' peak resident sets (VmHWM growth over the
resident set before the Trainer, high-water mark reset through /proc/self/clear_refs) are kept beside it in the
JSON (`timed_rss_bytes`) but not compared: they include what glibc keeps of freed memory and miss what a forked
rank reuses of its parent's freed heap, and the same layout's moved by 5-30% between runs (TP 2: 318 to 606 MiB).
The profiled runs' times are not used. The reading includes everything the training allocates as tensors: what
the planner counts (parameters, gradients, optimizer state, activations with the CPU loss head's chunk buffers,
FSDP transients), plus the data pipeline's token batches, which the comparison adds to the prediction
(host_extras below).
"""

from __future__ import annotations

import bisect
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from optimus.cli.errors import OneLineErrorParser  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import machine_info, prediction_accuracy  # noqa: E402
from optimus.config import load_config  # noqa: E402
from optimus.train.metrics import busiest_block_share  # noqa: E402
from tests.helpers.distributed import run_distributed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--train.dtype=fp32", "--train.seq_len=128", "--train.global_batch_size=8", "--train.log_every=1",
        "--train.eval_every=100000", "--train.ckpt_every=100000"]
DENSE, MOE = "configs/mula-tiny-dense.yaml", "configs/mula-tiny-moe.yaml"
# name -> (config, ranks, overrides)
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "dense-1": (DENSE, 1, []),
    "dense-fsdp2": (DENSE, 2, ["--parallel.dp_shard=2"]),
    "dense-zero1-2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=zero1"]),
    "dense-tp2": (DENSE, 2, ["--parallel.tp=2"]),
    "dense-pp2": (DENSE, 2, ["--parallel.pp=2", "--train.micro_batch_size=2"]),
    "dense-fsdp2-full-ac": (DENSE, 2, ["--parallel.dp_shard=2", "--train.activation_checkpointing=full"]),
    "moe-1": (MOE, 1, []),
    "moe-fsdp2-ep2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2"]),
    "moe-fsdp2-ep2-selective": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2",
                                         "--train.activation_checkpointing=selective"]),
    "moe-fsdp4-ep4": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=4"]),
    "moe-pp2-ep2": (MOE, 4, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.pp=2",
                             "--train.micro_batch_size=2"]),
    # the other layouts tests/distributed trains: DDP, HSDP, tp x pp, zero2 with EP, HSDP with EP, expert-tensor
    # parallelism under zero1 with the all-gather dispatch, the interleaved schedule
    "dense-ddp2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=ddp"]),
    "dense-hsdp2x2": (DENSE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2"]),
    "dense-tp2-pp2": (DENSE, 4, ["--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch_size=2"]),
    "moe-zero2-ep2-4": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.shard_mode=zero2"]),
    "moe-hsdp2x2-ep2": (MOE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2"]),
    "moe-tp2-ep2-zero1": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                   "--parallel.ep_dispatch=allgather", "--parallel.shard_mode=zero1"]),
    "moe-tp2-pp2-interleaved": (MOE, 4, ["--parallel.tp=2", "--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                         "--parallel.pp_virtual_stages=2", "--train.micro_batch_size=2"]),
    # kinds tests/distributed also trains: op-level selective recompute (test_data_parallel), the GPipe schedule
    # (test_pipeline), HSDP deferring its gradient sync to the last micro-batch (test_gradient_sync)
    "moe-fsdp2-ep2-selective-ops": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2",
                                             "--train.activation_checkpointing=selective_ops"]),
    "dense-pp2-gpipe": (DENSE, 2, ["--parallel.pp=2", "--parallel.pp_schedule=gpipe", "--train.micro_batch_size=2"]),
    "dense-hsdp2x2-defer": (DENSE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                       "--parallel.defer_grad_sync=all", "--train.micro_batch_size=1"]),
    # checkpointing under tp (test_expert_tensor_parallel's ops- and full-checkpointing layouts): what the
    # recompute communicates again differs by mode (block_collectives.replayed_collectives)
    "moe-tp2-selective-ops": (MOE, 2, ["--parallel.tp=2", "--train.activation_checkpointing=selective_ops"]),
    "moe-tp2-full-ac": (MOE, 2, ["--parallel.tp=2", "--train.activation_checkpointing=full"]),
    # gradients reduced in bf16 (parallel.grad_reduce_dtype): half the bytes of every gradient collective
    "dense-zero1-2-bf16-reduce": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=zero1",
                                             "--parallel.grad_reduce_dtype=bf16"]),
    "dense-ddp2-bf16-reduce": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=ddp",
                                          "--parallel.grad_reduce_dtype=bf16"]),
    "moe-fsdp2-ep2-bf16-reduce": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2",
                                           "--parallel.grad_reduce_dtype=bf16"]),
    # the 2-D layouts tests/distributed trains that the rows above lack: FSDP x TP, dense and MoE
    # (test_tensor_parallel), FSDP2 replicating over dp_replicate 2 (dp_shard 1) x TP (test_vocab_parallel, with
    # selective recompute), zero1 x TP and zero1 under PP (test_sharded_optimizer, an MoE: moe-pp2-zero1-2 below)
    "dense-fsdp2-tp2": (DENSE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2"]),
    "moe-fsdp2-tp2": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2"]),
    "dense-replicate2-tp2": (DENSE, 4, ["--parallel.tp=2", "--parallel.dp_replicate=2"]),
    "dense-zero1-2-tp2": (DENSE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.shard_mode=zero1"]),
    "dense-pp2-zero1-2": (DENSE, 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.shard_mode=zero1",
                                     "--parallel.pp_schedule=1f1b", "--train.micro_batch_size=2"]),
    # more layouts the distributed tests train (stop 37): FSDP over 4 with experts over 2 (test_expert_parallel),
    # tp x ep under FSDP (test_expert_tensor_parallel), plain MoE tp, MoE DDP, HSDP x ep under zero1 with selective
    # recompute (test_sharded_optimizer), an interleaved pipeline over FSDP x ep with the all-gather dispatch
    # (test_pipeline's checkpoint resume), the EP-unaware zero2 baseline under a GPipe pipeline
    # (test_sharded_optimizer), and selective recompute in an interleaved pipeline (test_pipeline)
    "moe-fsdp4-ep2": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2"]),
    "moe-fsdp2-tp2-ep2": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2"]),
    "moe-tp2": (MOE, 2, ["--parallel.tp=2"]),
    "moe-ddp2": (MOE, 2, ["--parallel.dp_replicate=2", "--parallel.shard_mode=ddp"]),
    "moe-zero1-2x2-ep2-selective": (MOE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                             "--parallel.shard_mode=zero1",
                                             "--train.activation_checkpointing=selective",
                                             "--train.recompute=[moe,norms]"]),
    "moe-pp2-ep2-interleaved-allgather": (MOE, 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                                   "--parallel.pp_schedule=interleaved_1f1b",
                                                   "--parallel.pp_virtual_stages=2", "--parallel.ep_dispatch=allgather",
                                                   "--train.micro_batch_size=2"]),
    "moe-pp2-zero2-ep2-unaware": (MOE, 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                           "--parallel.shard_mode=zero2", "--parallel.ep_aware=false",
                                           "--parallel.pp_schedule=gpipe", "--parallel.ep_dispatch=allgather",
                                           "--train.micro_batch_size=2"]),
    "moe-pp2-interleaved-selective": (MOE, 2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                               "--parallel.pp_virtual_stages=2", "--train.micro_batch_size=2",
                                               "--train.activation_checkpointing=selective",
                                               "--train.recompute=[attention,moe,norms]"]),
    # two micro-batches under HSDP, as test_gradient_sync trains the MoE: the all-reduce in the last backward (the
    # default), or every micro-batch's (defer_grad_sync=none; and DDP's so, as test_ddp trains it) (stop 39)
    "moe-hsdp2x2-mb1": (MOE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--train.micro_batch_size=1"]),
    "moe-hsdp2x2-sync-each": (MOE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                       "--parallel.defer_grad_sync=none", "--train.micro_batch_size=1"]),
    "dense-ddp2-sync-each": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=ddp",
                                        "--parallel.defer_grad_sync=none", "--train.micro_batch_size=2"]),
    # the kinds the distributed tests train that the rows above lacked (stop 40, read test by test): dense FSDP 4
    # (test_data_parallel), MoE FSDP without ep and at 4 (test_resharding, test_sharded_optimizer), FSDP in bf16
    # and zero1 in bf16 (test_sharded_optimizer), the all-gather dispatch over FSDP at ep 2 and 4
    # (test_expert_parallel), selective recompute at FSDP 4 x ep 2 (test_data_parallel), MoE tp x dp_replicate and
    # tp x pp under 1F1B (test_expert_tensor_parallel), FSDP and zero2 summing two micro-batches, FSDP with bf16
    # reduction (test_grad_reduce_dtype), MoE HSDP deferring everything (test_gradient_sync), FSDP replicating over
    # dp_replicate 2 alone and under pp 2 (test_heldout_eval, test_preemption), MoE pipelines alone
    # (test_pipeline), zero1 at FSDP 4 x ep 2 EP-aware and not, MoE zero1 under pp, MoE zero2 at ep 2 and zero1
    # over 3 ranks (test_sharded_optimizer), and one process, FSDP x ep and tp summing several micro-batches
    "dense-fsdp4": (DENSE, 4, ["--parallel.dp_shard=4"]),
    "moe-fsdp2-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--train.micro_batch_size=2"]),
    "moe-fsdp4": (MOE, 4, ["--parallel.dp_shard=4"]),
    "moe-fsdp4-ep2-selective": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2",
                                         "--train.activation_checkpointing=selective",
                                         "--train.recompute=[moe,norms]"]),
    "moe-fsdp2-ep2-allgather-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2",
                                             "--parallel.ep_dispatch=allgather", "--train.micro_batch_size=2"]),
    "moe-fsdp4-ep4-allgather": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=4",
                                         "--parallel.ep_dispatch=allgather"]),
    "moe-replicate2-tp2-mb2": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_replicate=2",
                                        "--train.micro_batch_size=2"]),
    "moe-tp2-pp2": (MOE, 4, ["--parallel.tp=2", "--parallel.pp=2", "--train.micro_batch_size=2"]),
    "dense-fsdp2-bf16-reduce-mb2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.grad_reduce_dtype=bf16",
                                               "--train.micro_batch_size=2"]),
    "dense-zero2-2-mb2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=zero2",
                                     "--train.micro_batch_size=2"]),
    "moe-hsdp2x2-defer": (MOE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                   "--parallel.defer_grad_sync=all", "--train.micro_batch_size=1"]),
    "dense-replicate2": (DENSE, 2, ["--parallel.dp_replicate=2"]),
    "dense-replicate2-pp2": (DENSE, 4, ["--parallel.dp_replicate=2", "--parallel.pp=2",
                                        "--train.micro_batch_size=2"]),
    "moe-pp2": (MOE, 2, ["--parallel.pp=2", "--train.micro_batch_size=2"]),
    "moe-zero1-ep2-4": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.shard_mode=zero1"]),
    "moe-zero1-ep2-4-unaware": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.shard_mode=zero1",
                                         "--parallel.ep_aware=false"]),
    "moe-pp2-zero1-2": (MOE, 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.shard_mode=zero1",
                                 "--train.micro_batch_size=2"]),
    "moe-zero2-2-ep2-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.shard_mode=zero2",
                                     "--train.micro_batch_size=2"]),
    "moe-zero1-3-mb2": (MOE, 3, ["--parallel.dp_shard=3", "--parallel.shard_mode=zero1",
                                 "--train.global_batch_size=12", "--train.micro_batch_size=2"]),
    "dense-1-mb2": (DENSE, 1, ["--train.micro_batch_size=2"]),
    "moe-fsdp2-ep2-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--train.micro_batch_size=2"]),
    "dense-tp2-mb2": (DENSE, 2, ["--parallel.tp=2", "--train.micro_batch_size=2"]),
    "dense-fsdp2-bf16": (DENSE, 2, ["--parallel.dp_shard=2", "--train.dtype=bf16"]),
    "dense-zero1-2-bf16": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=zero1", "--train.dtype=bf16"]),
    # the kinds the distributed tests train that the rows above still lacked (stop 41, read test by test again):
    # bf16 reduction under a pipeline and at HSDP, FSDP 4 x ep 2 and zero2 at ep 2 over 4 (test_grad_reduce_dtype),
    # zero2 under tp, full recompute under zero2 x ep and under FSDP alone, sub-module selective recompute under
    # tp x dp_replicate (test_expert_tensor_parallel, test_sharded_optimizer, test_data_parallel,
    # test_vocab_parallel), recompute with
    # the all-gather dispatch (test_data_parallel), bf16 compute with zero1 or with bf16 reduction
    # (test_grad_reduce_dtype, test_sharded_optimizer), the interleaved MoE pipeline alone (test_pipeline), the
    # EP-unaware zero2 (test_sharded_optimizer), DDP summing micro-batches under no_sync (test_ddp), and the 2-D
    # layouts summing two micro-batches as their tests do (test_tensor_parallel, test_expert_tensor_parallel)
    "moe-pp2-fsdp2-bf16-reduce": (MOE, 4, ["--parallel.pp=2", "--parallel.dp_shard=2", "--parallel.pp_schedule=1f1b",
                                           "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=2"]),
    "moe-tp2-zero2-selective-mb2": (MOE, 2, ["--parallel.tp=2", "--parallel.shard_mode=zero2",
                                             "--train.activation_checkpointing=selective", "--train.recompute=[moe]",
                                             "--train.micro_batch_size=2"]),
    "moe-zero2-2-ep2-full-ac-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.shard_mode=zero2",
                                             "--train.activation_checkpointing=full", "--train.micro_batch_size=2"]),
    "moe-fsdp4-ep2-allgather-selective": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2",
                                                   "--parallel.ep_dispatch=allgather",
                                                   "--train.activation_checkpointing=selective",
                                                   "--train.recompute=[moe,norms]"]),
    "dense-replicate2-tp2-selective-mb2": (DENSE, 4, ["--parallel.tp=2", "--parallel.dp_replicate=2",
                                                      "--train.activation_checkpointing=selective",
                                                      "--train.recompute=[attention,mlp,norms]",
                                                      "--train.micro_batch_size=2"]),
    "moe-zero2-ep2-4-bf16-reduce-mb1": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2",
                                                 "--parallel.shard_mode=zero2", "--parallel.grad_reduce_dtype=bf16",
                                                 "--train.micro_batch_size=1"]),
    "dense-hsdp2x2-bf16-reduce-mb1": (DENSE, 4, ["--parallel.dp_replicate=2", "--parallel.dp_shard=2",
                                                 "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=1"]),
    "moe-fsdp4-ep2-bf16-reduce-mb1": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2",
                                               "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=1"]),
    "moe-pp2-interleaved": (MOE, 2, ["--parallel.pp=2", "--parallel.pp_schedule=interleaved_1f1b",
                                     "--parallel.pp_virtual_stages=2", "--train.micro_batch_size=2"]),
    "moe-zero2-ep2-4-unaware": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.shard_mode=zero2",
                                         "--parallel.ep_aware=false"]),
    "dense-ddp2-mb2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=ddp", "--train.micro_batch_size=2"]),
    "moe-ddp2-mb2": (MOE, 2, ["--parallel.dp_replicate=2", "--parallel.shard_mode=ddp", "--train.micro_batch_size=2"]),
    "dense-zero2-2-bf16-reduce-mb2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=zero2",
                                                 "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=2"]),
    "dense-zero1-2-bf16-reduce-mb2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=zero1",
                                                 "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=2"]),
    "dense-ddp2-bf16-reduce-mb2": (DENSE, 2, ["--parallel.dp_shard=2", "--parallel.shard_mode=ddp",
                                              "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=2"]),
    "moe-fsdp2-full-ac-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--train.activation_checkpointing=full",
                                       "--train.micro_batch_size=2"]),
    "moe-tp2-ep2-zero1-mb2": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                       "--parallel.ep_dispatch=allgather", "--parallel.shard_mode=zero1",
                                       "--train.micro_batch_size=2"]),
    "moe-fsdp2-tp2-ep2-mb2": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.ep=2",
                                       "--train.micro_batch_size=2"]),
    "moe-fsdp2-tp2-mb2": (MOE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--train.micro_batch_size=2"]),
    "dense-fsdp2-tp2-mb2": (DENSE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--train.micro_batch_size=2"]),
    "dense-zero1-2-tp2-mb2": (DENSE, 4, ["--parallel.tp=2", "--parallel.dp_shard=2", "--parallel.shard_mode=zero1",
                                         "--train.micro_batch_size=2"]),
    "moe-zero2-3-mb2": (MOE, 3, ["--parallel.dp_shard=3", "--parallel.shard_mode=zero2",
                                 "--train.global_batch_size=12", "--train.micro_batch_size=2"]),
    "moe-zero1-4": (MOE, 4, ["--parallel.dp_shard=4", "--parallel.shard_mode=zero1"]),
    # a lone rank on every core's thread, as `optimus train` alone runs (make train): torch's intra-op threads
    "dense-1-all-cores": (DENSE, 1, []),
    "moe-1-all-cores": (MOE, 1, []),
    # bf16 compute, where the CPU has it natively (skipped elsewhere: emulated bf16 is not what auto would run)
    "dense-1-bf16": (DENSE, 1, ["--train.dtype=bf16"]),
    "moe-1-bf16": (MOE, 1, ["--train.dtype=bf16"]),
    "moe-fsdp2-ep2-bf16": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--train.dtype=bf16"]),
    "moe-1-all-cores-bf16": (MOE, 1, ["--train.dtype=bf16"]),
    "moe-zero1-2-ep2-bf16-bf16-reduce-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2",
                                                      "--parallel.shard_mode=zero1", "--train.dtype=bf16",
                                                      "--parallel.grad_reduce_dtype=bf16",
                                                      "--train.micro_batch_size=2"]),
    "moe-fsdp2-ep2-bf16-bf16-reduce-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--train.dtype=bf16",
                                                    "--parallel.grad_reduce_dtype=bf16", "--train.micro_batch_size=2"]),
    "moe-zero1-2-ep2-bf16-mb2": (MOE, 2, ["--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.shard_mode=zero1",
                                          "--train.dtype=bf16", "--train.micro_batch_size=2"]),
}
ALL_CORES = {"dense-1-all-cores", "moe-1-all-cores", "moe-1-all-cores-bf16"}  # the rest: one thread a rank
SMOKE = ("dense-1", "moe-fsdp2-ep2")


def layout_threads(name: str) -> int:
    """Intra-op threads each rank of layout `name` runs (the planner is told the same: here.here_cluster)."""
    from optimus.plan.here import cores

    return cores() if name in ALL_CORES else 1


def needs_native_bf16(name: str) -> bool:
    return "--train.dtype=bf16" in LAYOUTS[name][2]


def host_extras(config) -> float:
    """Host bytes a training step holds beyond the planner's terms: the data pipeline's input and label batch."""
    t = config.train
    return 2 * 8 * t.global_batch_size * t.seq_len


def _rss() -> tuple[int, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def allocator_peak(events) -> int:
    """The most CPU-allocator bytes live at once in a profiler's event tree (profile_memory=True), counting only
    blocks allocated while it ran.

    Rebuilt block by block from the allocation and free events, not read from their running total: the CPU
    allocator records a free only on a thread the profiler runs on, so a tensor that a gloo worker thread releases
    (expert-parallel all-to-all buffers held by their async work) is never subtracted from the total, which then
    climbs ~10 MiB a step (MoE FSDP 2 + EP 2: 684 MiB after 3 steps, 737 after 8, while the resident set stayed
    flat). Two live blocks never share a byte, so a new block over any part of one still held here means that one
    was freed unseen: it is dropped then. Matching start addresses alone missed the blocks the allocator reused in
    part (a smaller block cut from a larger freed one): one rank in four, or both of DDP's under bf16 reduction,
    read 35-150 MiB high (MoE FSDP 2 x TP 2: 404 MiB where its other ranks read 358-387, 351 predicted; DDP 2 with
    bf16 reduction 819 MiB, 667 predicted; with overlaps 354 and 691). So the profiled runs keep glibc's default
    allocator, which maps a large block fresh and hands it back on free: the next ones land at once where an
    unseen free left room. With the trainer's reuse (train/host_memory.py) the heap places them elsewhere and one
    rank in four read 50-100 MiB high (MoE HSDP 2 x 2 + EP 2: 745 MiB vs 644).
    """
    from torch._C._profiler import _EventType

    stack, allocations = list(events), []
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            allocations.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
    allocations.sort()
    starts: list[int] = []  # the live blocks' addresses, sorted (live blocks never overlap)
    sizes: dict[int, int] = {}
    current = peak = 0
    for _, size, address in allocations:
        if size <= 0:  # a free seen
            if address in sizes:
                current -= sizes.pop(address)
                del starts[bisect.bisect_left(starts, address)]
            continue
        # a new block over any part of a live one means that one was freed unseen before
        i = bisect.bisect_left(starts, address + size)
        while i > 0 and starts[i - 1] + sizes[starts[i - 1]] > address:
            current -= sizes.pop(starts.pop(i - 1))
            i -= 1
        starts.insert(i, address)
        sizes[address] = size
        current += size
        peak = max(peak, current)
    return peak


def _train_rank(rank: int, world: int, config_path: str, overrides: list[str], profile_memory: bool = False,
                threads: int = 1) -> dict:
    """(one forked rank, `threads` intra-op threads) train as `optimus train` does; return the peak growth of the
    resident set, and with `profile_memory` the allocator's peak (see the module's docstring)."""
    torch.set_num_threads(threads)  # the parent stays on one: a fork after it ran several could hang (CPU-NOTES)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group exists already: init_distributed returns
    from optimus.train.trainer import Trainer

    if profile_memory:  # glibc as it comes (see allocator_peak): live bytes do not depend on it, the reading does
        overrides = [*overrides, "--train.reuse_host_memory=false"]
    config = load_config(config_path, overrides)
    try:
        Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set to the current one
    except OSError:
        pass
    from torch.profiler import ProfilerActivity, profile

    base, _ = _rss()
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if profile_memory else None
    with profiler or contextlib.nullcontext():
        Trainer(config, progress_bar=False).fit()
    _, peak = _rss()
    result = {"rank": rank, "base_rss": base, "peak_rss": peak, "growth": peak - base}
    if profiler is not None:
        result["allocator_peak"] = allocator_peak(profiler.profiler.kineto_results.experimental_event_tree())
    return result


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _measured_steps(rows: list[dict], warmup: int, tokens_per_step: int) -> list[float]:
    steps = [r for r in rows if "tokens_per_s" in r and r.get("step", 0) > warmup]
    return [tokens_per_step / r["tokens_per_s"] for r in steps]


def logged_routing(rows: list[dict]):
    """The run's routing as `optimus plan --moe-routing` reads it (plan/routing.LoggedRouting: its logged expert
    counts, each step's [layer][expert] summed over the data-parallel ranks), or None without expert counts."""
    from optimus.plan.routing import LoggedRouting

    return LoggedRouting.of_records(rows, "the measured run")


def paced_share(rows: list[dict], expert_blocks: int, warmup: int, layers: list[int] | None = None) -> float | None:
    """What the step time waits for: each layer's exchange or tensor-parallel sum waits for its busiest rank, so a
    step's expert GEMMs take the layers' mean of their busiest block's share (over `layers`, default all; the
    trainer logs it as expert_rank_load_mean); the median over the measured steps (after `warmup`), as the
    measured step time is (the planner's --moe-routing takes the mean: a run's time is the sum of its steps).
    Over all layers, the trainer's own reading where it logged one (expert_rank_load_mean: the slowest
    expert-exchange group's, from the group's own tokens, where the data-parallel ranks form several groups).
    None without expert counts or split experts."""
    logged = [r for r in rows if r.get("expert_counts") and r.get("step", 0) > warmup]
    if expert_blocks == 1 or not logged:
        return None
    if layers is None and all("expert_rank_load_mean" in r for r in logged):
        return statistics.median(r["expert_rank_load_mean"] for r in logged)
    counts = torch.tensor([r["expert_counts"] for r in logged], dtype=torch.float64)
    counts = counts if layers is None else counts[:, layers]
    return statistics.median(busiest_block_share(counts, expert_blocks).mean(dim=1).tolist())


def stage_layers(layout, stage: int) -> list[int]:
    """The layers pipeline rank `stage` holds (its virtual stages' contiguous chunks: parallel/pipeline.py)."""
    from optimus.parallel.pipeline import rank_layers

    virtual = layout.config.parallel.pp_virtual_stages if layout.dims.pp > 1 else 1
    return rank_layers(layout.config.model.n_layers, layout.dims.pp, virtual, stage)


def in_fresh_process(fn, *args):
    """fn(*args) in a fresh interpreter (spawned, not forked; fn importable from an optimus module): the parent
    forks every rank, and a rank of several threads hangs in its first parallel op if its parent ever ran
    several (CPU-NOTES), so what runs several threads here (the all-cores probes, a calibration on every core)
    runs there."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _layout(config_path: str, ranks: int, overrides: list[str]):
    from optimus.parallel.validate import validate_layout

    return validate_layout(load_config(config_path, overrides), ranks)


def predicted_memory_bytes(layout, routing_imbalance: float | dict[int, float] = 1.0) -> float:
    """The planner's largest rank of the first and last pipeline stage, its loss head as the CPU runs it."""
    from optimus.plan.memory import ModelShape, peak_memory

    return peak_memory(layout.config, layout.dims, ModelShape.of(layout.config), True, routing_imbalance)


def calibrated_entry(layout, cache_file: Path, cpu_cache, threads: int = 1) -> dict:
    """This host's machine entry with the op classes timed at this layout's shapes and threads (as `optimus plan
    --calibrate` does) and the cores' share now (others may be using them)."""
    from optimus.plan.calibrate import calibrate_op_classes
    from optimus.plan.calibrate_collectives import measure_share
    from optimus.plan.here import machine

    entry = machine(cache_file, cpu_cache)
    entry = {**entry, "machine": {**entry["machine"], "share": measure_share()}}
    if threads == 1:
        entry.update(calibrate_op_classes(layout.config, entry))
    else:
        entry.update(in_fresh_process(calibrate_op_classes, layout.config, entry, threads))
    return entry


def priced_steps(layout, clusters: list) -> list:
    """The planner's StepTime of `layout` on each `here` cluster (one per calibration)."""
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import step_time

    shape = ModelShape.of(layout.config)
    return [step_time(layout.config, layout.dims, shape, c, None, layout.batch.micro_batches) for c in clusters]


# two calibrations whose predictions differ by more than this had another tenant on the cores during one of them:
# a third is taken and the one farthest from the other two dropped (a calibration reading the cores' share at 0.68
# while the runs went at full speed put a row 16% high until it was re-timed: BENCHMARKS.md, stop 47)
CALIBRATION_SPREAD = 0.15


def calibrations_disagree(a: float, b: float) -> bool:
    """Whether two calibrations' step predictions differ by more than CALIBRATION_SPREAD of the smaller."""
    return max(a, b) / min(a, b) - 1 > CALIBRATION_SPREAD


def odd_one_out(steps: list[float]) -> int:
    """The index of the prediction farthest from the others' mean (of three: the pair that agrees best stays)."""
    def distance(i: int) -> float:
        rest = [s for j, s in enumerate(steps) if j != i]
        return abs(steps[i] - statistics.mean(rest))
    return max(range(len(steps)), key=distance)


def with_collectives(entry: dict, collectives: dict | None) -> dict:
    """The machine entry priced on `collectives` (a table timed for this row) instead of its cached one."""
    return entry if collectives is None else {**entry, "machine": {**entry["machine"], "collectives": collectives}}


def job_collectives(ranks: int, cached: dict) -> dict:
    """The cached gloo table with the rows of a job of `ranks` timed again now: the whole job, the pairs timed
    inside it (COLLECTIVE_SUBGROUPS), its alpha-beta fit and its sync after compute; other job sizes as cached."""
    from optimus.plan.calibrate_collectives import COLLECTIVE_SUBGROUPS, measure_collectives

    fresh = measure_collectives(worlds=(ranks,), subgroups=tuple(s for s in COLLECTIVE_SUBGROUPS if s[1] == ranks))
    kept = [row for row in cached.get("rows", []) if row.get("job", row["ranks"]) != ranks]
    return {**cached, "rows": kept + fresh["rows"], "fits": {**cached.get("fits", {}), **fresh["fits"]},
            "sync_after_compute": {**cached.get("sync_after_compute", {}), **fresh["sync_after_compute"]}}


def predict(layout, ranks: int, cache_file: Path, cpu_cache, calibrate: bool, threads: int = 1,
            routing_imbalance: float | None = None, earlier: dict | None = None,
            collectives: dict | None = None) -> dict:
    """The planner's step time (and its parts) and per-rank memory for this layout (validated) on `here`, each rank on
    `threads` threads; with `calibrate`, from the op classes timed now (calibrated_entry), and with `earlier` (a
    calibration before the timed runs) the mean of the two predictions: the host's other work moves a calibration
    by up to 18% minutes apart, and two readings halve that noise (the faster of the two, tried first, read the
    table 5.6% fast on average: BENCHMARKS.md, stop 32); where the two disagree (calibrations_disagree), a third is
    taken and the odd one out dropped. Each is priced whole: a calibration's efficiencies are
    fractions of its own peak reading. With `routing_imbalance` (the busiest rank's share each layer waits for),
    the step time at it too; with `collectives` (job_collectives), every calibration on that table."""
    from optimus.plan.here import here_cluster, machine
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import step_time

    shape = ModelShape.of(layout.config)
    entries = [with_collectives(entry, collectives) for entry in
               [calibrated_entry(layout, cache_file, cpu_cache, threads) if calibrate
                else machine(cache_file, cpu_cache)] + ([earlier] if earlier is not None else [])]
    clusters = [here_cluster(entry, ranks, threads) for entry in entries]
    times = priced_steps(layout, clusters)
    dropped = []
    if calibrate and len(times) == 2 and calibrations_disagree(times[0].step_s, times[1].step_s):
        entries.append(with_collectives(calibrated_entry(layout, cache_file, cpu_cache, threads), collectives))
        clusters.append(here_cluster(entries[-1], ranks, threads))
        times += priced_steps(layout, clusters[-1:])
        odd = odd_one_out([t.step_s for t in times])
        dropped = [times[odd].step_s]
        entries, clusters, times = ([x for i, x in enumerate(xs) if i != odd] for xs in (entries, clusters, times))
    parts = {key: statistics.mean(t.parts[key] for t in times) for key in times[0].parts}
    at_routing = {}
    if routing_imbalance is not None:
        at_routing = {"step_at_routing_s": statistics.mean(
            step_time(layout.config, layout.dims, shape, c, None, layout.batch.micro_batches,
                      routing_imbalance).step_s for c in clusters)}
    memory = predicted_memory_bytes(layout)
    extras = host_extras(layout.config)
    return {"step_s": statistics.mean(t.step_s for t in times), "parts": parts, **at_routing, "memory_bytes": memory,
            "host_extras": extras, "calibrated": "efficiency" in entries[0],
            "efficiency": clusters[0].efficiency.to_dict(), "share": entries[0]["machine"].get("share"),
            "calibrations_step_s": [t.step_s for t in times], "dropped_calibrations_step_s": dropped,
            # what each prediction was priced from, less the collectives' table (the JSON holds it once): enough to
            # price the row again exactly (benchmarks/plan_here_stored.py)
            "priced_from": [{"machine": {k: v for k, v in entry["machine"].items() if k != "collectives"},
                             "efficiency": entry.get("efficiency")} for entry in entries]}


def _train_once(config_path: str, ranks: int, overrides: list[str], warmup: int, profile_memory: bool = False,
                threads: int = 1) -> tuple[list[float], list[dict], float, list[dict]]:
    """One short training run: its measured step times, each rank's memory, its wall time, its metrics."""
    with tempfile.TemporaryDirectory(prefix="optimus-pvm-") as tmp:
        run_overrides = [*overrides, f"--run.dir={tmp}/run"]
        config = load_config(config_path, run_overrides)
        start = time.perf_counter()
        ranks_out = run_distributed(_train_rank, ranks, config_path, run_overrides, profile_memory, threads,
                                    timeout=900.0)
        wall = time.perf_counter() - start
        metrics = _metrics(Path(tmp) / "run")
        measured = _measured_steps(metrics, warmup, config.train.global_batch_size * config.train.seq_len)
    return measured, ranks_out, wall, metrics


def default_memory_runs(ranks: int) -> int:
    """Profiled runs a layout's memory reading takes by default: two where gloo's threads free tensors unseen (each
    rank's least over them), one for a lone rank, whose reading is exact."""
    return 2 if ranks > 1 else 1


def run_layout(name: str, steps: int, warmup: int, cache_file: Path, cpu_cache, calibrate: bool = True,
               model: list[str] = (), repeats: int = 1, memory_runs: int | None = None,
               row_table: bool = False) -> dict:
    """Train one layout briefly (`repeats` times; none: memory only) and predict it; the row of the table.
    memory_runs: the profiled runs (None: default_memory_runs); row_table: price a timed multi-rank row on its job
    size's collectives timed just before its runs (job_collectives)."""
    from optimus.plan.here import machine

    config_path, ranks, extra = LAYOUTS[name]
    memory_runs = default_memory_runs(ranks) if memory_runs is None else memory_runs
    config_path = str(ROOT / config_path)
    overrides = [*BASE, *model, *extra, f"--train.max_steps={warmup + steps}"]
    threads = layout_threads(name)
    layout = _layout(config_path, ranks, overrides)
    # the op classes timed before the runs too: predict takes the mean of this and its own calibration after them
    earlier = calibrated_entry(layout, cache_file, cpu_cache, threads) if calibrate and repeats else None
    collectives = (job_collectives(ranks, machine(cache_file, cpu_cache)["machine"]["collectives"])
                   if row_table and repeats and ranks > 1 else None)
    runs = [_train_once(config_path, ranks, overrides, warmup, threads=threads) for _ in range(repeats)]
    fastest = min(range(len(runs)), key=lambda i: statistics.median(runs[i][0])) if runs else None
    # the routing the fastest run's layers waited for (the pipeline's pace is its last stage's)
    last_stage = stage_layers(layout, layout.dims.pp - 1) if layout.dims.pp > 1 else None
    paced = (paced_share(runs[fastest][3], layout.dims.ep * layout.dims.tp, warmup, last_stage)
             if runs and layout.config.model.is_moe else None)
    predicted = predict(layout, ranks, cache_file, cpu_cache, calibrate and bool(runs), threads, paced, earlier,
                        collectives)
    timed = {}
    if runs:
        measured, _, wall, _ = runs[fastest]
        step = statistics.median(measured)
        timed = {"measured_step_s": step, "measured_steps_s": measured, "predicted_step_s": predicted["step_s"],
                 "step_error": predicted["step_s"] / step - 1, "predicted_parts_s": predicted["parts"],
                 "wall_s": wall, "run_medians_s": [statistics.median(r[0]) for r in runs],
                 "calibrations_step_s": predicted["calibrations_step_s"], "priced_from": predicted["priced_from"],
                 "config": str(Path(config_path).relative_to(ROOT)), "config_overrides": overrides,
                 **({"collectives": collectives} if collectives is not None else {})}
        if paced is not None:
            at_routing = predicted["step_at_routing_s"]
            timed.update({"paced_routing_imbalance": paced, "predicted_step_at_routing_s": at_routing,
                          "step_error_at_routing": at_routing / step - 1})
    # memory: the allocator's peak in the profiled runs, the least of them (each rank's least where there are
    # several, below); the timed runs' resident peaks only where no memory run was asked for
    profiled = [_train_once(config_path, ranks, overrides, warmup, profile_memory=True, threads=threads)
                for _ in range(memory_runs)]
    timed_peaks = [max(r["growth"] for r in run[1]) for run in runs]
    key = "allocator_peak" if profiled else "growth"
    candidates = profiled or runs
    peaks = [max(r[key] for r in run[1]) for run in candidates]
    least = min(range(len(candidates)), key=peaks.__getitem__)
    ranks_out, memory = candidates[least][1], peaks[least]
    if len(profiled) > 1:  # a rank's reading only ever errs high (allocator_peak: frees unseen), and its true peak
        # is the same in every run (same data, same routing): each rank's least over the runs, the largest rank's
        memory = max(min(run[1][rank][key] for run in profiled) for rank in range(len(ranks_out)))
    predicted_memory = predicted["memory_bytes"] + predicted["host_extras"]
    # what the memory model gives at the routing this run had (the prediction above assumes balanced routing)
    routing = {}
    logged = logged_routing(candidates[least][3]) if layout.dims.ep * layout.dims.tp > 1 else None
    if logged is not None:  # each stage at the routing of its own layers, as `optimus plan --moe-routing` prices it
        stages = logged.shares(layout.config, layout.dims)[0]
        at_routing = predicted_memory_bytes(layout, stages) + predicted["host_extras"]
        routing = {"routing_imbalance": max(stages.values()), "predicted_memory_at_routing_bytes": at_routing,
                   "memory_error_at_routing": at_routing / memory - 1}
    return {"layout": name, "ranks": ranks, "threads": threads, "overrides": extra, **timed,
            "measured_memory_bytes": memory,
            "predicted_memory_bytes": predicted_memory, "planner_memory_bytes": predicted["memory_bytes"],
            "memory_error": predicted_memory / memory - 1, **routing, "rank_rss": ranks_out,
            "memory_measure": "allocator peak" if profiled else "resident set", "memory_runs": len(profiled),
            "timed_rss_bytes": timed_peaks,
            "calibrated": predicted["calibrated"], "efficiency": predicted["efficiency"], "share": predicted["share"]}


def main(argv: list[str] | None = None) -> int:
    parser = OneLineErrorParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="benchmarks/results/plan_vs_measured.json", help="where to write the rows")
    parser.add_argument("--steps", type=int, default=4, help="measured steps after the warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per layout; the fastest run's median "
                                                               "counts (0: memory only, no time compared)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--memory-runs", type=int, default=None,
                        help="further runs per layout for the allocator's peak, profiled, each rank's least reading "
                             "(default: 2 for several ranks, 1 for one; 0: the timed runs' resident set instead)")
    parser.add_argument("--only", default=None, help="comma-separated layout names (default: all); 'smoke': "
                                                     + ",".join(SMOKE))
    parser.add_argument("--cache", default=None, help="the `here` calibration cache (default: the CLI's)")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="use the cached efficiencies instead of timing the op classes at each layout's shapes")
    parser.add_argument("--row-tables", action="store_true",
                        help="time the gloo collectives of each multi-rank row's job size just before its runs and "
                             "price the row on them (15-55 s a row) instead of the cached table")
    parser.add_argument("--model", default="", help="extra --model.* overrides for every layout, comma-separated "
                                                    "(a smaller model for a quick check)")
    args = parser.parse_args(argv)
    memory_runs = 1 if args.memory_runs is None else args.memory_runs  # (the default is at least one)
    if args.repeats < 0 or memory_runs < 0 or args.repeats + memory_runs == 0:
        print("--repeats and --memory-runs: counts of 0 or more, not both 0 (nothing would be measured)",
              file=sys.stderr)
        return 2
    from optimus.cli import here_cache_files

    cache_file, cpu_cache = here_cache_files()
    if args.cache:
        cache_file = Path(args.cache)
    names = list(LAYOUTS) if not args.only else (list(SMOKE) if args.only == "smoke" else args.only.split(","))
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        print(f"unknown layout {unknown[0]}: choose from {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    from optimus.plan.here import busy_note, machine

    # measured (where it never was) away from this process, which must not run several threads itself
    measured = in_fresh_process(machine, cache_file, cpu_cache)["machine"]
    native_bf16 = measured["auto_dtype"] == "bf16"
    busy = busy_note(measured.get("load_at_measure"), measured["cores"], f"when {cache_file} was measured")
    if busy:
        print(busy, file=sys.stderr)
    for name in [n for n in names if needs_native_bf16(n) and not native_bf16]:
        print(f"{name}: skipped, this CPU computes bf16 by emulation (train.dtype auto runs fp32 here)")
    names = [n for n in names if native_bf16 or not needs_native_bf16(n)]
    rows = []
    print(f"{'layout':<26} {'ranks':>5} {'measured s':>10} {'predicted s':>11} {'err':>7} {'meas MiB':>9} "
          f"{'pred MiB':>9} {'err':>7}", flush=True)
    for name in names:
        row = run_layout(name, args.steps, args.warmup, cache_file, cpu_cache, not args.no_calibrate,
                         [m for m in args.model.split(",") if m], args.repeats, args.memory_runs, args.row_tables)
        rows.append(row)
        timed = (f"{row['measured_step_s']:>10.3f} {row['predicted_step_s']:>11.3f} {row['step_error']:>+7.1%}"
                 if "step_error" in row else f"{'-':>10} {'-':>11} {'-':>7}")
        routing = (f"  (routing {row['routing_imbalance']:.2f}x: {row['predicted_memory_at_routing_bytes'] / 2**20:.0f}"
                   f" MiB, {row['memory_error_at_routing']:+.1%})" if "routing_imbalance" in row else "")
        if "paced_routing_imbalance" in row:
            routing += (f"  (time at routing {row['paced_routing_imbalance']:.2f}x: "
                        f"{row['predicted_step_at_routing_s']:.3f} s, {row['step_error_at_routing']:+.1%})")
        resident = " (resident set)" if row["memory_measure"] != "allocator peak" else ""
        print(f"{name:<26} {row['ranks']:>5} {timed} {row['measured_memory_bytes'] / 2**20:>9.0f} "
              f"{row['predicted_memory_bytes'] / 2**20:>9.0f} {row['memory_error']:>+7.1%}{resident}{routing}",
              flush=True)
    # memory is judged against the allocator's peak; a row without a profiled run (--memory-runs 0) read only its
    # resident set's growth, which holds what the allocator keeps after frees and the libraries' own pages
    profiled = [r for r in rows if r["memory_measure"] == "allocator peak"]
    if args.repeats:
        print(f"step time within 15%: {sum(abs(r['step_error']) <= 0.15 for r in rows)}/{len(rows)}; ", end="")
    print(f"memory within 10%: {sum(abs(r['memory_error']) <= 0.10 for r in profiled)}/{len(profiled)}" +
          (f" ({len(rows) - len(profiled)} row(s) without a profiled run read the resident set: not judged)"
           if len(profiled) < len(rows) else ""))
    if args.repeats:
        print(prediction_accuracy([r["step_error"] for r in rows]))
    routed = [r for r in rows if "step_error_at_routing" in r or "memory_error_at_routing" in r]
    if routed:  # the MoE rows with split experts, each at the routing its run had
        timed = [r for r in routed if "step_error_at_routing" in r]
        sized = [r for r in routed if "memory_error_at_routing" in r and r["memory_measure"] == "allocator peak"]
        print(f"at each run's routing ({len(routed)} MoE rows with split experts): " +
              (f"step time within 15%: {sum(abs(r['step_error_at_routing']) <= 0.15 for r in timed)}/{len(timed)} "
               f"(balanced: {sum(abs(r['step_error']) <= 0.15 for r in timed)}); " if timed else "") +
              (f"memory within 10%: {sum(abs(r['memory_error_at_routing']) <= 0.10 for r in sized)}/{len(sized)} "
               f"(balanced: {sum(abs(r['memory_error']) <= 0.10 for r in sized)})" if sized else "memory not judged"))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"machine": machine_info(), "steps": args.steps, "warmup": args.warmup,
                                           "repeats": args.repeats, "memory_runs": args.memory_runs,
                                           "collectives": measured["collectives"], "rows": rows},
                                          indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
