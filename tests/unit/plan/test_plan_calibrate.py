"""--calibrate's pieces: the op-class timings, the `here` cluster built from them and the timed collectives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from optimus.config import load_config
from optimus.plan.calibrate import OPTIMIZER_ELEMENTS, measure_op_classes
from optimus.plan.calibrate_collectives import COLLECTIVE_TIMING, COLLECTIVES
from optimus.plan.efficiency import Efficiency
from optimus.plan.here import CPU_DEFAULT_EFFICIENCY, here_cluster, rank_threads
from optimus.plan.step_time import OPTIMIZER_BYTES_PER_ELEMENT

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def test_op_classes_are_timed_at_the_model_shapes_and_read_as_fractions_of_peak():
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=fp32", "--train.seq_len=32",
                                                            "--train.micro_batch_size=1", "--model.vocab_size=512"])
    out = measure_op_classes(config, "fp32", peak_flops=1e12, copy_bytes_s=1e12)  # a peak no CPU core reaches
    eff, timed = Efficiency.from_dict(out["efficiency"], "test"), out["timed"]
    for name in ("dense_gemm", "grouped_gemm", "attention", "loss_head"):
        assert timed[name]["seconds"] > 0
        assert getattr(eff, name) == pytest.approx(timed[name]["flops"] / timed[name]["seconds"] / 1e12)
    # 32 tokens: grouped GEMM FLOPs are 18 T k d fe
    assert timed["grouped_gemm"]["flops"] == 18.0 * 32 * 4 * 256 * 512
    assert timed["op_overhead"]["operators"] > 100 and eff.op_overhead_us > 0
    # the trainer's clipping and AdamW step over OPTIMIZER_ELEMENTS parameters, at step_time's bytes per parameter
    assert timed["optimizer"]["bytes"] == OPTIMIZER_ELEMENTS * OPTIMIZER_BYTES_PER_ELEMENT
    assert eff.optimizer == pytest.approx(timed["optimizer"]["bytes"] / timed["optimizer"]["seconds"] / 1e12)
    # FSDP's copies: its gather's copy-in and copy-out and its reduce's copy-in (fp32 into fp32), 16 M elements
    assert timed["buffer_copy"]["bytes"] == 16 * 1024 * 1024 * (4 * 4 + 4 + 4)
    assert eff.buffer_copy == pytest.approx(timed["buffer_copy"]["bytes"] / timed["buffer_copy"]["seconds"] / 1e12)


def test_the_optimizer_class_defaults_to_memory_bound_and_may_beat_a_copy():
    assert Efficiency.from_dict({"memory_bound": 0.4}, "preset").optimizer == 0.4  # presets, older caches
    assert Efficiency.from_dict({"memory_bound": 0.4, "optimizer": 2.2}, "cache").optimizer == 2.2
    for bad in ({"optimizer": 9.0}, {"memory_bound": 1.5}, {"buffer_copy": 9.0}):
        with pytest.raises(ValueError, match="out of range"):
            Efficiency.from_dict(bad, "cache")


def test_the_buffer_copies_default_to_memory_bound_and_are_timed_as_fsdp_copies():
    """Presets price data parallelism's copies as the other memory-bound work unless they say; a cast into the
    reduce dtype is part of what is timed (a bf16 reduce of fp32 gradients: 2 bytes written a reduced element)."""
    assert Efficiency.from_dict({"memory_bound": 0.4}, "preset").buffer_copy == 0.4
    assert Efficiency(memory_bound=0.3).buffer_copy == 0.3
    assert Efficiency.from_dict({"memory_bound": 0.4, "buffer_copy": 1.3}, "cache").buffer_copy == 1.3
    import torch

    from optimus.plan.calibrate import measure_buffer_copies

    timed = measure_buffer_copies(torch.float32, torch.bfloat16)
    assert timed["seconds"] > 0 and timed["bytes"] == 16 * 1024 * 1024 * (4 * 4 + 4 + 2)


@pytest.mark.parametrize("parallel, experts, share", [(["--parallel.dp_shard=2", "--parallel.ep=2"], 8, 1),
                                                     (["--parallel.tp=2"], 8, 2),
                                                     (["--parallel.dp_shard=4", "--parallel.ep=4", "--parallel.tp=2"], 2, 2)])
def test_the_experts_are_timed_as_one_ep_x_tp_rank_computes_them(parallel, experts, share):
    config = load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.dtype=fp32", "--train.seq_len=32",
                                                            "--train.micro_batch_size=1", "--model.vocab_size=512",
                                                            *parallel])
    timed = measure_op_classes(config, "fp32", peak_flops=1e12, copy_bytes_s=1e12)["timed"]["grouped_gemm"]
    # its E / (ep tp) of the 16 experts, and its 1 / tp of the micro-batch's T k expert FLOPs (top 4 of 16)
    assert timed["experts"] == experts
    assert timed["flops"] == 18.0 * 32 * 4 * 256 * 512 / share


def test_under_tp_the_op_classes_are_timed_as_one_tp_rank_holds_them():
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32", "--train.seq_len=32",
                                                              "--train.micro_batch_size=1", "--model.vocab_size=512",
                                                              "--parallel.tp=2"])
    m = config.model
    timed = measure_op_classes(config, "fp32", peak_flops=1e12, copy_bytes_s=1e12)["timed"]
    # the loss head over half the vocabulary, the projections at half their width, half the heads
    assert timed["loss_head"]["flops"] == 6.0 * 32 * m.d_model * 256
    d, kv, f = m.d_model, m.kv_heads * m.head_dim, m.ffn_hidden
    assert timed["dense_gemm"]["flops"] == 6.0 * 32 * (2 * d * d + 2 * d * kv + 3 * d * f) / 2
    assert timed["attention"]["flops"] == 12.0 * 32 * (m.n_heads // 2) * m.head_dim * 32


def test_here_cluster_shares_the_host_between_ranks():
    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    entry = {"machine": {"cpu": "c", "cores": 2, "memory_bytes": 8 * 1024**3, "fp32_flops_per_thread": 3e10,
                         "bf16_flops_per_thread": 1e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
                         "copy_gb_s_all_cores": 10.0, "collectives": {"timing": "mean call", "rows": [], "fits": {"2": fit, "4": fit}},
                         "measured_at": "t"},
             "efficiency": Efficiency(0.5, 0.4, 0.3, 0.2, 10.0, 0.6).to_dict()}
    two, four = here_cluster(entry, 2), here_cluster(entry, 4)
    assert two.peak_flops("fp32") == 3e10 and four.peak_flops("fp32") == 1.5e10  # 4 ranks on 2 cores
    assert two.memory_gb == 4 and four.memory_gb == 2
    # a rank streams with one thread, and no faster than its part of the socket
    assert here_cluster(entry, 1).hbm_gb_s == 8.0 and two.hbm_gb_s == 5.0 and four.hbm_gb_s == 2.5
    # ...but its elementwise work and optimizer update are bound by its share of the cores, not its part of the socket
    assert two.core_bandwidth_gb_s == 8.0 and four.core_bandwidth_gb_s == 4.0
    assert here_cluster(entry, 1).core_bandwidth_gb_s == 8.0
    assert two.efficiency.op_overhead_us == 10.0 and four.efficiency.op_overhead_us == 20.0
    assert two.efficiency.loss_head == 0.6 and two.intra_node_latency_us == 100.0 and two.auto_dtype == "fp32"
    assert two.fresh_page_s_per_byte == 0.0  # a cache from before the fresh pages were measured
    entry["machine"]["fresh_page_s_per_byte"] = 4e-10  # faults run on the rank's share of a core
    assert here_cluster(entry, 2).fresh_page_s_per_byte == 4e-10 and here_cluster(entry, 4).fresh_page_s_per_byte == 8e-10
    assert here_cluster(entry, 2).fresh_block_bytes == 32 * 1024 * 1024
    del entry["efficiency"]["optimizer"]  # a calibration from before the optimizer step was timed
    assert here_cluster(entry, 2).efficiency.optimizer == CPU_DEFAULT_EFFICIENCY.optimizer
    del entry["efficiency"]["buffer_copy"]  # nor the buffer copies
    assert here_cluster(entry, 2).efficiency.buffer_copy == CPU_DEFAULT_EFFICIENCY.buffer_copy == 1.0


def test_a_rank_runs_omp_num_threads_else_every_core_alone_and_one_among_several():
    from optimus.plan.here import cores

    assert rank_threads(1, {}) == cores() and rank_threads(2, {}) == 1  # torch's default; torchrun's
    assert rank_threads(1, {"OMP_NUM_THREADS": "3"}) == 3 and rank_threads(4, {"OMP_NUM_THREADS": "2"}) == 2
    assert rank_threads(1, {"OMP_NUM_THREADS": "0"}) == cores() and rank_threads(2, {"OMP_NUM_THREADS": "x"}) == 1
    # OpenMP's forms: a count per nesting level (torch's pool runs the first), a sign; a digit OpenMP would not read
    assert rank_threads(1, {"OMP_NUM_THREADS": "4,2"}) == 4 and rank_threads(2, {"OMP_NUM_THREADS": "+3"}) == 3
    assert rank_threads(2, {"OMP_NUM_THREADS": "\u00b2"}) == 1 and rank_threads(2, {"OMP_NUM_THREADS": "\u0664"}) == 1


def test_a_rank_of_several_threads_gets_their_share_of_the_all_cores_rate():
    """A lone `optimus train` on a 2-core host runs both cores (1.13 s a step of make train's job on a 2-core EPYC,
    priced 1.76 s as one thread): its peak is the all-cores probe, its bandwidth the threads' copy rate."""
    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    machine = {"cpu": "c", "cores": 2, "memory_bytes": 8 * 1024**3, "fp32_flops_per_thread": 3e10,
               "bf16_flops_per_thread": 6e10, "fp32_flops_all_cores": 5.4e10, "bf16_flops_all_cores": 1.1e11,
               "auto_dtype": "bf16", "copy_gb_s_one_thread": 8.0, "copy_gb_s_all_cores": 10.0,
               "collectives": {"timing": "mean call", "rows": [], "fits": {"2": fit}}, "measured_at": "t"}
    one, both = here_cluster({"machine": machine}, 1), here_cluster({"machine": machine}, 1, threads=2)
    assert one.peak_flops("fp32") == 3e10 and both.peak_flops("fp32") == 5.4e10
    assert both.peak_flops("bf16") == 1.1e11 and one.hbm_gb_s == 8.0 and both.hbm_gb_s == 10.0
    assert here_cluster({"machine": machine}, 1, threads=8).peak_flops("fp32") == 5.4e10  # no more than the cores
    # two ranks of two threads on two cores: each thread gets half a core
    shared = here_cluster({"machine": machine}, 2, threads=2)
    assert shared.peak_flops("fp32") == pytest.approx(2.7e10) and shared.hbm_gb_s == pytest.approx(5.0)
    assert not shared.comm_overlaps_compute and shared.core_share == 0.5
    del machine["fp32_flops_all_cores"]  # a cache from before the all-cores probe: one thread's rate per thread
    assert here_cluster({"machine": machine}, 1, threads=2).peak_flops("fp32") == 6e10


def test_op_classes_are_calibrated_on_the_ranks_threads_against_their_rates(monkeypatch):
    from optimus.plan import calibrate

    seen = {}

    def fake_measure(config, dtype, peak_flops, copy_bytes_s):
        import torch

        seen.update(dtype=dtype, peak=peak_flops, copy=copy_bytes_s, threads=torch.get_num_threads())
        return {"efficiency": {}, "timed": {}}

    monkeypatch.setattr(calibrate, "measure_op_classes", fake_measure)
    monkeypatch.setattr("optimus.train.hardware.best_matmul_rate", lambda *args: 1.0)  # never above the cache
    machine = {"cores": 2, "fp32_flops_per_thread": 3e10, "bf16_flops_per_thread": 1e8, "fp32_flops_all_cores": 5.4e10,
               "bf16_flops_all_cores": 2e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
               "copy_gb_s_all_cores": 10.0}
    config = load_config(CONFIGS / "mula-tiny-dense.yaml", ["--train.dtype=fp32"])
    out = calibrate.calibrate_op_classes(config, {"machine": machine}, threads=2)
    assert out["calibrated_threads"] == 2
    assert seen == {"dtype": "fp32", "peak": 5.4e10, "copy": 10e9, "threads": 2}
    assert calibrate.calibrate_op_classes(config, {"machine": machine})["calibrated_threads"] == 1
    assert seen == {"dtype": "fp32", "peak": 3e10, "copy": 8e9, "threads": 1}


def test_fresh_page_cost_is_a_non_negative_cost_per_byte():
    from optimus.plan.here import fresh_page_cost

    cost = fresh_page_cost(repeats=2)
    assert 0.0 <= cost < 1e-6  # per byte: under a millisecond per kilobyte whatever the host


def test_measured_share_of_the_cores_replaces_the_idle_assumption():
    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    machine = {"cpu": "c", "cores": 2, "memory_bytes": 8 * 1024**3, "fp32_flops_per_thread": 3e10,
               "bf16_flops_per_thread": 1e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
               "copy_gb_s_all_cores": 32.0, "collectives": {"timing": "mean call", "rows": [], "fits": {"2": fit}}, "measured_at": "t",
               "share": {"1": 1.0, "2": 0.5, "4": 0.2}}  # a busy machine: 2 ranks get half a core each
    two, four = here_cluster({"machine": machine}, 2), here_cluster({"machine": machine}, 4)
    assert two.peak_flops("fp32") == pytest.approx(1.5e10) and four.peak_flops("fp32") == pytest.approx(6e9)
    assert two.hbm_gb_s == pytest.approx(4.0) and two.efficiency.op_overhead_us == pytest.approx(20.0)
    # a job size not measured: the nearest one's cores spread over its ranks (3 ranks: 4 ranks' 4 x 0.2 over 3; 8
    # ranks: 4 ranks' over 8), never past what the cores allow each (cores / ranks)
    assert here_cluster({"machine": machine}, 3).peak_flops("fp32") == pytest.approx(3e10 * 0.8 / 3)
    assert here_cluster({"machine": machine}, 8).peak_flops("fp32") == pytest.approx(3e10 * 0.8 / 8)
    idle = {**machine, "share": {"1": 1.0, "2": 1.0, "4": 0.5}}
    assert here_cluster({"machine": idle}, 3).peak_flops("fp32") == pytest.approx(3e10 * 2 / 3)
    # a job size measured is priced as measured (a 3-rank job, timed since 3-rank ZeRO-1 read 16% slow from 4's)
    timed_three = {**machine, "share": {**machine["share"], "3": 0.3}}
    assert here_cluster({"machine": timed_three}, 3).peak_flops("fp32") == pytest.approx(3e10 * 0.3)


def test_every_job_size_the_tests_run_is_timed_and_an_older_cache_gets_the_missing_share(tmp_path, monkeypatch):
    """1-4 ranks: a 3-rank job reads its own collectives and share, not 4 ranks' rescaled; a cache whose share
    was measured for fewer job sizes has it measured again once, its collectives kept."""
    from optimus.plan import calibrate_collectives
    from optimus.plan import here

    assert calibrate_collectives.COLLECTIVE_WORLDS == (2, 3, 4)
    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    timed = {"rows": [], "fits": {"2": fit}, "timing": calibrate_collectives.COLLECTIVE_TIMING}
    old = {"cpu": "c", "cores": 2, "fresh_page_s_per_byte": 0.0, "host_memory": here.HOST_MEMORY,
           "fp32_flops_all_cores": 1.0, "collectives": timed, "share": {"1": 1.0, "2": 0.9, "4": 0.45}}
    here.write_cache(tmp_path / "plan_here.json", {"machine": old})
    shares = {"1": 1.0, "2": 0.9, "3": 0.6, "4": 0.45}
    monkeypatch.setattr(calibrate_collectives, "measure_share", lambda: shares)
    monkeypatch.setattr(calibrate_collectives, "measure_collectives", lambda: pytest.fail("collectives timed again"))
    entry = here.machine(tmp_path / "plan_here.json")
    assert entry["machine"]["share"] == shares and entry["machine"]["collectives"] == timed
    monkeypatch.setattr(calibrate_collectives, "measure_share", lambda: pytest.fail("share measured again"))
    here.machine(tmp_path / "plan_here.json")


def test_a_cache_timed_before_bursts_has_its_collectives_timed_again(tmp_path, monkeypatch):
    """The table once held the fastest single call after a barrier (a 1 MiB all-gather: 0.40 ms, where a step pays
    1.56 ms a call): a cache without the sustained timing is re-timed once, the rest of it kept; so are fresh
    pages timed before the trainer kept freed memory for reuse."""
    from optimus.plan import calibrate_collectives
    from optimus.plan import here

    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    old = {"cpu": "c", "cores": 2, "fresh_page_s_per_byte": 1e-10, "collectives": {"rows": [], "fits": {"2": fit}}}
    here.write_cache(tmp_path / "plan_here.json", {"machine": old})
    timed = {"rows": [], "fits": {"2": fit}, "timing": calibrate_collectives.COLLECTIVE_TIMING}
    monkeypatch.setattr(calibrate_collectives, "measure_collectives", lambda: timed)
    monkeypatch.setattr(here, "fresh_page_cost", lambda: 0.0)  # the old cache's was timed without the trainer's reuse
    entry = here.machine(tmp_path / "plan_here.json")
    assert entry["machine"]["collectives"] == timed and entry["machine"]["fresh_page_s_per_byte"] == 0.0
    assert entry["machine"]["host_memory"] == here.HOST_MEMORY and entry["machine"]["cores"] == 2
    assert here.read_cache(tmp_path / "plan_here.json")["machine"]["collectives"] == timed
    monkeypatch.setattr(calibrate_collectives, "measure_collectives", lambda: pytest.fail("timed again"))
    monkeypatch.setattr(here, "fresh_page_cost", lambda: pytest.fail("fresh pages timed again"))
    here.machine(tmp_path / "plan_here.json")


def test_a_pair_inside_a_larger_job_is_priced_from_the_pairs_timed_in_that_job():
    """A collective of 2 ranks in a 4-rank job reads the pairs timed inside a 4-rank job: beside a pipeline's other
    stage, those timed while the other pair computes ("2/4+compute"); else those timed with every pair at once
    ("2/4"), on 2 cores too (the ranks' drift apart under time slicing is the sync after compute's, which stop 36's
    weighing of the two tables by the step's compute share counted again). A 2-rank job reads the pairs timed alone
    ("2"), 4 ranks their own rows."""
    from optimus.parallel.mesh import ParallelDims
    from optimus.plan.comms import group_link, ring_time

    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    rows = [{"op": "all_gather", "ranks": 2, "bytes": 1 << 20, "seconds": 1e-3},
            {"op": "all_gather", "ranks": 4, "bytes": 1 << 20, "seconds": 3e-3},
            {"op": "all_gather", "ranks": 2, "job": 4, "others": "compute", "bytes": 1 << 20, "seconds": 2.5e-3},
            {"op": "all_gather", "ranks": 2, "job": 4, "others": "collectives", "bytes": 1 << 20, "seconds": 2e-3}]
    entry = {"machine": {"cpu": "c", "cores": 2, "memory_bytes": 8 * 1024**3, "fp32_flops_per_thread": 3e10,
                         "bf16_flops_per_thread": 1e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
                         "copy_gb_s_all_cores": 10.0, "measured_at": "t",
                         "collectives": {"timing": COLLECTIVE_TIMING, "rows": rows, "fits": {"2": fit, "4": fit}}}}
    tp2_of_4, tp2_of_2 = ParallelDims(tp=2, dp_shard=2, world_size=4), ParallelDims(tp=2, world_size=2)
    on_two_cores = here_cluster(entry, 4)
    assert ring_time(group_link(tp2_of_4, ("tp",), on_two_cores), 1 << 20) == pytest.approx(2e-3)
    four_cores = {"machine": {**entry["machine"], "cores": 4}}
    assert ring_time(group_link(tp2_of_4, ("tp",), here_cluster(four_cores, 4)), 1 << 20) == pytest.approx(2e-3)
    assert ring_time(group_link(tp2_of_2, ("tp",), here_cluster(entry, 2)), 1 << 20) == pytest.approx(1e-3)
    assert ring_time(group_link(ParallelDims(dp_shard=4, world_size=4), ("dp_shard_mod_ep",), here_cluster(entry, 4)),
                     1 << 20) == pytest.approx(3e-3)
    tp2_pp2 = ParallelDims(tp=2, pp=2, world_size=4)  # beside a pipeline's other stage the other pair computes
    assert ring_time(group_link(tp2_pp2, ("tp",), here_cluster(entry, 4)), 1 << 20) == pytest.approx(2.5e-3)
    del rows[2:]  # a table without the pairs in a 4-rank job: the 2-rank job's rows
    assert ring_time(group_link(tp2_of_4, ("tp",), here_cluster(entry, 4)), 1 << 20) == pytest.approx(1e-3)


def _sync_entry(sync: dict) -> dict:
    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    rows = [{"op": op, "ranks": g, "bytes": b, "seconds": g * 1e-3 * (1 + b / (1 << 20))}
            for op in COLLECTIVES for g in (2, 4) for b in (4096, 1 << 20, 64 << 20)]
    return {"machine": {"cpu": "c", "cores": 2, "memory_bytes": 8 * 1024**3, "fp32_flops_per_thread": 3e10,
                        "bf16_flops_per_thread": 1e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
                        "copy_gb_s_all_cores": 10.0, "measured_at": "t",
                        "collectives": {"timing": COLLECTIVE_TIMING, "rows": rows, "fits": {"2": fit, "4": fit},
                                        "sync_after_compute": sync}}}


def test_here_takes_what_a_call_after_compute_costs_from_the_nearest_job_size():
    sync = {"2": [[0.01, 1e-3], [0.04, 2e-3]], "4": [[0.01, 3e-3], [0.04, 5e-3]]}
    entry = _sync_entry(sync)
    assert here_cluster(entry, 2).collective_sync == ((0.01, 1e-3), (0.04, 2e-3))
    assert here_cluster(entry, 4).collective_sync == here_cluster(entry, 3).collective_sync == ((0.01, 3e-3),
                                                                                                (0.04, 5e-3))
    assert here_cluster(entry, 1).collective_sync == ()  # a lone rank waits for no one
    assert here_cluster(_sync_entry({}), 4).collective_sync == ()  # a cache timed before it: nothing added
    from optimus.plan.calibrate import describe

    assert "  a collective reached after compute, 4 ranks: 3.00 ms after 10 ms, 5.00 ms after 40 ms of compute, " \
           "beyond the table" in describe(entry)


def test_a_call_after_compute_costs_what_was_timed_after_the_layouts_compute_between_collectives():
    """Every timed collective pays the sync at the layout's compute between two of its collectives: the step's
    collectives counted by what one more microsecond a call adds, its compute (the step less its waits on
    collectives) split between them; linear between the timed points, the last one's past them, linear from nothing
    below the first."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import COLLECTIVE_PARTS, step_time, sync_after_compute

    points = ((0.01, 1e-3), (0.04, 4e-3))
    assert sync_after_compute(points, 0.1) == 4e-3 and sync_after_compute(points, 0.02) == pytest.approx(2e-3)
    # below the first point, linear from nothing: no compute between two calls is the back-to-back call timed
    assert sync_after_compute(points, 0.005) == pytest.approx(0.5e-3) and sync_after_compute(points, 0.0) == 0.0
    # (FSDP alone: tensor parallelism's calls are priced each at their own compute, the next test)
    layout = validate_layout(load_config(None, ["--model.preset=mula-tiny-dense", "--train.dtype=fp32",
                                                "--parallel.dp_shard=4"]), 4)
    args = (layout.config, layout.dims, ModelShape.of(layout.config))
    cluster = here_cluster(_sync_entry({"4": [list(p) for p in points]}), 4)
    plain = step_time(*args, replace(cluster, collective_sync=()), None, layout.batch.micro_batches)
    flat = step_time(*args, replace(cluster, collective_sync=((1e-6, 2e-3), (0.04, 2e-3))), None,
                     layout.batch.micro_batches)
    nudged = step_time(*args, replace(cluster, collective_sync=(), collective_sync_s=1e-3), None,
                       layout.batch.micro_batches)
    collectives = (nudged.step_s - plain.step_s) / 1e-3
    assert collectives > 10  # FSDP's gathers and reduce-scatters, every layer
    assert flat.step_s == pytest.approx(plain.step_s + 2e-3 * collectives, rel=1e-3)
    between = (plain.step_s - sum(plain.parts[p] for p in COLLECTIVE_PARTS)) / collectives
    timed = step_time(*args, cluster, None, layout.batch.micro_batches)
    assert timed.step_s == pytest.approx(plain.step_s + sync_after_compute(points, between) * collectives, rel=1e-3)
    # one rank (no collectives) and a preset (no such table) are priced as before
    lone = validate_layout(load_config(None, ["--model.preset=mula-tiny-dense", "--train.dtype=fp32"]), 1)
    lone_args = (lone.config, lone.dims, ModelShape.of(lone.config))
    with_sync = replace(here_cluster(_sync_entry({"4": [list(p) for p in points]}), 1), collective_sync=points)
    unsynced = replace(with_sync, collective_sync=())
    assert step_time(*lone_args, with_sync).step_s == step_time(*lone_args, unsynced).step_s


TP_CASES = [  # (overrides, ranks): each activation-checkpointing mode's replays, dense and MoE, with and without pp
    (["--model.preset=mula-tiny-dense", "--parallel.tp=2"], 2),
    (["--model.preset=mula-tiny-dense", "--parallel.tp=2", "--train.activation_checkpointing=full"], 2),
    (["--model.preset=mula-tiny-dense", "--parallel.tp=2", "--train.activation_checkpointing=selective_ops"], 2),
    (["--model.preset=mula-tiny-moe", "--parallel.tp=2", "--train.activation_checkpointing=full"], 2),
    (["--model.preset=mula-tiny-moe", "--parallel.tp=2", "--train.activation_checkpointing=selective",
      "--train.recompute=[attention]"], 2),
    (["--model.preset=mula-tiny-moe", "--parallel.tp=2", "--parallel.ep=2", "--parallel.dp_shard=2"], 4),
    (["--model.preset=mula-tiny-dense", "--parallel.tp=2", "--parallel.dp_replicate=2",  # FSDP's norm reduces
      "--train.activation_checkpointing=selective", "--train.recompute=[attention,mlp,norms]"], 4),
    (["--model.preset=mula-tiny-dense", "--parallel.tp=2", "--parallel.pp=2", "--model.qk_norm=false"], 4),
]


@pytest.mark.parametrize("overrides, ranks", TP_CASES)
def test_every_tensor_parallel_call_has_the_compute_before_it(overrides, ranks):
    """tensor_parallel_call_gaps lists one gap per call tensor_parallel_time prices (what one more second of sync a
    call adds to it), and a flat sync curve prices the calls as one sync for every call did."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.block_collectives import (TensorParallelGaps, replayed_collectives, tensor_parallel_call_gaps,
                                                tensor_parallel_time)

    layout = validate_layout(load_config(None, ["--train.dtype=fp32", *overrides]), ranks)
    config, dims = layout.config, layout.dims
    cluster = here_cluster(_sync_entry({str(ranks): [[0.01, 1e-3], [0.04, 2e-3]]}), ranks)
    layers, act, again = 2, 1 << 20, replayed_collectives(config)
    gaps = TensorParallelGaps(qkv=3e-3, attention=4e-3, mlp=11e-3, between=6e-3, head=0.2)
    calls = (tensor_parallel_time(config, dims, replace(cluster, collective_sync_s=1.0), layers, act, again) -
             tensor_parallel_time(config, dims, cluster, layers, act, again))
    assert len(tensor_parallel_call_gaps(config, dims, layers, again, gaps)) == pytest.approx(calls)
    flat = replace(cluster, collective_sync=((1e-6, 2e-3), (1.0, 2e-3)))
    assert tensor_parallel_time(config, dims, flat, layers, act, again, gaps) == pytest.approx(
        tensor_parallel_time(config, dims, replace(cluster, collective_sync_s=2e-3), layers, act, again))


def test_tensor_parallel_calls_come_in_the_blocks_order():
    """A dense block with QK-norm at tp 2, as profiled: all-gather after a few operators, q's all-reduce after the
    q/k/v projections, k's right after, the reduce-scatter after attention, the all-gather after a few operators,
    the reduce-scatter after the MLP; the backward mirrors each at twice the compute; full checkpointing runs the
    gathers, the scatters and QK-norm's all-reduces again after the compute they follow in the forward."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.block_collectives import TensorParallelGaps, replayed_collectives, tensor_parallel_call_gaps

    gaps = TensorParallelGaps(qkv=3.0, attention=4.0, mlp=11.0, between=6.0, head=60.0)
    for mode, replayed in (("none", []), ("full", [1, 1, 5, 12, 4, 1])):
        layout = validate_layout(load_config(None, ["--model.preset=mula-tiny-dense", "--train.dtype=fp32",
                                                    "--parallel.tp=2", "--train.micro_batch_size=1",
                                                    f"--train.activation_checkpointing={mode}"]), 2)
        config = layout.config
        listed = tensor_parallel_call_gaps(config, layout.dims, 1, replayed_collectives(config), gaps)
        forward = [1, 4, 1, 5, 1, 12]
        block = forward + [2 * g for g in forward] + replayed
        assert listed[:len(block)] == block
        # the root: the head's gather, one statistics gather per chunk of rows, its scatter back, the embedding's two
        assert listed[-5:] == [1, 60, 120, 1, 1]


def test_tensor_parallel_calls_after_a_few_operators_pay_less_than_at_the_mean_compute():
    """Where a call reached after compute costs more the longer the ranks computed (linear from nothing up to the
    first timed point), tp's calls priced at their own compute cost less than all of them at the mean: half
    follow a few operators. A layout without tp is priced as before (the test above), one with it no lower
    than without any sync."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.memory import ModelShape
    from optimus.plan.step_time import COLLECTIVE_PARTS, step_time, sync_after_compute

    points = ((0.01, 1e-3), (0.04, 4e-3))
    layout = validate_layout(load_config(None, ["--model.preset=mula-tiny-dense", "--train.dtype=fp32",
                                                "--parallel.tp=2"]), 2)
    args = (layout.config, layout.dims, ModelShape.of(layout.config))
    cluster = here_cluster(_sync_entry({"2": [list(p) for p in points]}), 2)
    plain = step_time(*args, replace(cluster, collective_sync=()), None, layout.batch.micro_batches)
    nudged = step_time(*args, replace(cluster, collective_sync=(), collective_sync_s=1e-3), None,
                       layout.batch.micro_batches)
    collectives = (nudged.step_s - plain.step_s) / 1e-3
    between = (plain.step_s - sum(plain.parts[p] for p in COLLECTIVE_PARTS)) / collectives
    timed = step_time(*args, cluster, None, layout.batch.micro_batches)
    assert plain.step_s < timed.step_s < plain.step_s + sync_after_compute(points, between) * collectives


def test_the_memory_bound_block_takes_each_outputs_gradient_or_a_sum():
    """On an accelerator each output is written and its own gradient read back (what memory_bound_bytes counts; a
    compiled sum would skip both); on the CPU the outputs are summed, as `here`'s calibrations were timed."""
    from optimus.models.layers import RMSNorm
    from optimus.plan.calibrate import memory_bound_block, memory_bound_call

    def inputs():
        torch.manual_seed(0)
        return tuple(torch.randn(6, n, requires_grad=True) for n in (4, 8, 8, 4))
    block = memory_bound_block(RMSNorm(4))
    whole = inputs()
    torch.manual_seed(1)
    expected = [torch.randn(6, 4), torch.randn(6, 8), torch.randn(6, 4)]  # the gradients memory_bound_call draws
    torch.manual_seed(1)
    memory_bound_call(block, whole, writes_outputs=True)()
    assert torch.equal(whole[3].grad, expected[2])  # the residual's input gets its output's gradient
    summed = inputs()
    memory_bound_call(block, summed, writes_outputs=False)()
    assert torch.equal(summed[3].grad, torch.ones(6, 4))


def test_a_rank_is_priced_at_no_more_threads_than_the_machine_has_cores():
    """rate_probe and thread_rate: a rank's threads past the cores add nothing. On 2 cores 8 threads run at the
    all-cores probe's 5.4e10 (per core 2.7e10 x 2 cores); on 1 core several threads read the one-thread probe,
    whatever an all-cores entry holds."""
    from optimus.plan.here import rate_probe, thread_rate

    two = {"cores": 2, "fp32_flops_per_thread": 3e10, "fp32_flops_all_cores": 5.4e10}
    assert thread_rate(two, "fp32", 8) == pytest.approx(5.4e10)
    one = {**two, "cores": 1}
    assert rate_probe(one, "fp32", 4) == ("fp32_flops_per_thread", 1)
    assert thread_rate(one, "fp32", 4) == pytest.approx(3e10)


def _fake_machine(cores: int, fitted_ranks: str, **changes) -> dict:
    """A `here` machine entry of `cores` cores (fp32 3e10 a thread, bf16 crawling, copies 8 / 32 GB/s), its gloo
    collectives fitted for a job of `fitted_ranks` ranks; `changes` replace or add keys."""
    fit = {"alpha_us": 100.0, "beta_gb_s": 2.0, "worst_relative_error": 0.1}
    return {"cpu": "c", "cores": cores, "memory_bytes": 8 * 1024**3, "fp32_flops_per_thread": 3e10,
            "bf16_flops_per_thread": 1e8, "auto_dtype": "fp32", "copy_gb_s_one_thread": 8.0,
            "copy_gb_s_all_cores": 32.0, "measured_at": "t",
            "collectives": {"timing": "mean call", "rows": [], "fits": {fitted_ranks: fit}}, **changes}


def test_the_measured_share_prices_one_thread_ranks_only():
    """The measured share comes from one-thread matmul processes: a job of 2 ranks of 2 threads on 4 cores keeps
    its idle share (4 cores / 4 threads = 1) and runs 2 threads at the all-cores probe's per-core rate,
    8e10 / 4 x 2 = 4e10, although one-thread pairs measured half a core each."""
    machine = _fake_machine(4, "2", bf16_flops_per_thread=6e10, fp32_flops_all_cores=8e10,
                            bf16_flops_all_cores=1.6e11, copy_gb_s_all_cores=20.0, share={"1": 1.0, "2": 0.5})
    cluster = here_cluster({"machine": machine}, 2, threads=2)
    assert cluster.peak_flops("fp32") == pytest.approx(4e10) and cluster.core_share == 1.0


def test_a_job_size_not_timed_reads_the_nearest_job_of_several_ranks_not_the_lone_rank():
    """A share measured for one rank says nothing of ranks competing for cores: 2 ranks where only 1 and 4 were
    timed take 4 ranks' cores (4 x 0.25 = 1 core) spread over 2, half a core each (1.5e10 of a 3e10 thread), not
    the lone rank's 0.8 over 2."""
    machine = _fake_machine(2, "2", share={"1": 0.8, "4": 0.25})
    assert here_cluster({"machine": machine}, 2).peak_flops("fp32") == pytest.approx(1.5e10)


def test_a_job_size_not_timed_never_gets_more_than_a_whole_core_a_rank():
    """On 8 cores where only 4 one-thread ranks were timed (each a whole core), 3 ranks spread 4 cores' worth over
    themselves only up to their idle share: one core each (3e10), not 4/3 of one."""
    machine = _fake_machine(8, "4", share={"1": 1.0, "4": 1.0})
    assert here_cluster({"machine": machine}, 3).peak_flops("fp32") == pytest.approx(3e10)


def test_collectives_overlap_compute_only_where_a_core_is_left_over():
    """gloo moves a collective's bytes on the ranks' own cores: it runs beside compute only where the ranks'
    threads leave a core free (1 rank on 2 cores), not where they fill every core (2 ranks, or 1 of 2 threads)."""
    machine = _fake_machine(2, "2")
    assert here_cluster({"machine": machine}, 1).comm_overlaps_compute
    assert not here_cluster({"machine": machine}, 2).comm_overlaps_compute
    assert not here_cluster({"machine": machine}, 1, threads=2).comm_overlaps_compute
