"""What of the GPU-only scripts (benchmarks/plan_gpu.py, benchmarks/step_profile.py, tests/gpu/resume_check.py) runs
without a GPU: the kernel classes, the idle split by step phase, the host summary, the preset chosen per GPU name,
every case's prediction, the steps measured on GPUs before priced within the issue's bands, and the resume check's
rewinding of a run directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.plan_gpu import CASES, case_overrides, cluster_for_device, main, predict, stored_rows
from benchmarks.step_profile import _union, host_summary, idle_by_phase, idle_gaps, kernel_class
from tests.gpu.resume_check import resumed_at, rewind


@pytest.mark.parametrize("name, label", [
    ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "dense_gemm"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "dense_gemm"),
    ("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversalINS5_17"
     "GroupProblemShapeIN4cute5tupleIJiiiEEEEE", "grouped_gemm"),
    ("_grouped_rows_kernel", "grouped_gemm"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<float>>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "memory_bound"),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_1", "memory_bound"),
])
def test_kernels_sort_into_the_planners_classes(name, label):
    assert kernel_class(name) == label


def test_busy_time_is_the_union_of_kernel_intervals():
    assert _union([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4


def test_gpu_idle_is_split_by_the_steps_phases():
    # one step: forward_backward 0-100 us with kernels over 10-60 and 80-120, optimizer_step 100-130 with none beyond
    phases = [("optimus.forward_backward", 0, 100), ("optimus.optimizer_step", 100, 130)]
    split = idle_by_phase(phases, [(10, 60), (80, 120)], steps=1)
    assert split["optimus.forward_backward"] == pytest.approx({"host_s": 100e-6, "gpu_idle_s": 30e-6})
    assert split["optimus.optimizer_step"] == pytest.approx({"host_s": 30e-6, "gpu_idle_s": 10e-6})


def test_gpu_idle_gaps_are_counted_by_length_and_by_the_kernels_around_them():
    # two steps: a 3 us and a 50 us gap after "norm" (the second overlapped by "gemm" running on), a 2 ms stall
    kernels = [("norm", 0, 10), ("gemm", 13, 100), ("add", 20, 40), ("silu", 150, 160), ("norm", 2160, 2170)]
    gaps = idle_gaps(kernels, steps=2)
    assert gaps["by_length"]["0-5 us"] == pytest.approx({"count": 0.5, "s": 1.5e-6})
    assert gaps["by_length"]["20-100 us"] == pytest.approx({"count": 0.5, "s": 25e-6})  # from gemm's end, not add's
    assert gaps["by_length"][">= 1000 us"] == pytest.approx({"count": 0.5, "s": 1e-3})
    assert gaps["by_length"]["5-20 us"]["count"] == 0
    assert list(gaps["top_pairs_s"]) == ["silu -> norm", "gemm -> silu", "norm -> gemm"]


def test_the_host_summary_counts_operators_and_ranks_self_time_per_step():
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(2):  # two "steps"
            torch.ones(64, 64).mm(torch.ones(64, 64)).relu()
    summary = host_summary(profiler.events(), steps=2, top=3)
    assert summary["aten_ops_per_step"] >= 3  # ones twice, mm, relu (their inner aten calls too)
    assert summary["launches_per_step"] == 0  # no GPU
    assert len(summary["top_host_s"]) == 3 and all(s >= 0 for s in summary["top_host_s"].values())
    assert list(summary["top_host_s"].values()) == sorted(summary["top_host_s"].values(), reverse=True)


def test_the_preset_follows_the_gpus_name():
    assert cluster_for_device("NVIDIA H200") == "h200"
    assert cluster_for_device("NVIDIA H100 80GB HBM3") == "h100"
    with pytest.raises(SystemExit, match="--cluster"):
        cluster_for_device("AMD Instinct MI300X")


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_case_is_a_valid_one_device_layout_the_planner_prices(case):
    predicted = predict(*case_overrides(case, steps=5, warmup=3), "h200")
    assert 0 < predicted["step_s"] < 10
    assert 0 < predicted["memory_bytes"] < 141 * 1024**3


def test_every_step_measured_on_a_gpu_stays_within_the_issues_bands():
    """The planner changes where no GPU is lent: the 19 steps measured on two H200s and an H100 (gpu_measured.json),
    priced from the presets alone as they are now, stay within issue 11's bands (15% step time, 10% memory)."""
    rows = stored_rows()
    assert len(rows) == 19 and {r["cluster"] for r in rows} == {"h100", "h200"}
    for row in rows:
        where = f"{row['device']} {row['case']} {row['overrides']}"
        assert abs(row["step_error"]) <= 0.15, where
        assert abs(row["memory_error"]) <= 0.10, where


def test_the_h200s_own_calibration_prices_its_steps_as_the_preset_does():
    """An H200's node calibration (benchmarks/gpu_calibrated_h200.yaml, from microbenchmarks by their kernels' time,
    none of the steps) prices only that kind's 11 stored steps, each within issue 11's 15% (8.6% on average and
    11.6% at most when it was written; the preset, fitted to profiled steps, 5.8%), the memory as the preset does."""
    calibrated = stored_rows(cluster=str(Path(__file__).resolve().parents[2] / "benchmarks/gpu_calibrated_h200.yaml"))
    assert len(calibrated) == 11 and all(r["device"] == "NVIDIA H200" for r in calibrated)
    assert all(abs(r["step_error"]) <= 0.15 for r in calibrated), [r["step_error"] for r in calibrated]
    preset = [r for r in stored_rows() if r["device"] == "NVIDIA H200"]
    assert [r["predicted_memory_gib"] for r in calibrated] == [r["predicted_memory_gib"] for r in preset]


def test_a_calibration_at_one_sequence_a_micro_batch_prices_the_stored_steps_by_its_table_of_rows(tmp_path):
    """The Mula configs calibrate at their own micro-batch, 1 x 2,048 tokens, where the H200's kernels ran slowest
    (projections 0.60 of peak, experts 0.28). Priced at those rates alone, the stored steps (4 and 8 sequences a
    micro-batch) read up to 40% slow; with the rates tabulated by rows each step is priced at its own micro-batch's,
    whatever micro-batch the efficiency block was timed at."""
    stored = Path(__file__).resolve().parents[2] / "benchmarks/gpu_calibrated_h200.yaml"
    at_one = stored.read_text()
    for name, at_four, at_1 in (("dense_gemm", 0.6917, 0.598), ("grouped_gemm", 0.4783, 0.277),
                                ("attention", 0.6195, 0.455), ("loss_head", 0.5323, 0.495)):
        assert f"\n  {name}: {at_four}\n" in at_one, name
        at_one = at_one.replace(f"\n  {name}: {at_four}\n", f"\n  {name}: {at_1}\n")
    (tmp_path / "table.yaml").write_text(at_one)
    (tmp_path / "alone.yaml").write_text(at_one[:at_one.index("  # the compute classes by rows")])
    with_table = stored_rows(cluster=str(tmp_path / "table.yaml"))
    assert [r["predicted_step_s"] for r in with_table] == [r["predicted_step_s"] for r in stored_rows(
        cluster=str(stored))]
    alone = stored_rows(cluster=str(tmp_path / "alone.yaml"))
    assert max(r["step_error"] for r in alone) > 0.35  # +39.7% when this was written


def test_a_cluster_that_does_not_load_is_named_not_the_stored_file(tmp_path):
    with pytest.raises(SystemExit, match=r"plan_gpu: --cluster nowhere.yaml: cluster file 'nowhere.yaml' not found"):
        main(["--stored", "--cluster", "nowhere.yaml", "--json", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()


def test_a_file_that_is_not_gpu_measurements_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": [{"rows": [{}]}]}')
    with pytest.raises(SystemExit, match="not a file of GPU measurements"):
        main(["--stored", str(bad), "--json", str(tmp_path / "out.json")])
    assert not (tmp_path / "out.json").exists()


def _run_dir(path, steps: int, checkpoints: list[int]):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 10.0 - s}) + "\n"
                                                for s in range(1, steps + 1)))
    for step in checkpoints:
        (path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (path / "latest").write_text(str(checkpoints[-1]))
    return path


def test_rewind_leaves_the_run_as_it_stood_after_the_checkpoint(tmp_path):
    straight = _run_dir(tmp_path / "straight", 8, [4, 8])
    rewind(straight, tmp_path / "copy", 4)
    copy = tmp_path / "copy"
    assert sorted(p.name for p in (copy / "checkpoints").iterdir()) == ["step-4"]
    assert (copy / "latest").read_text() == "4"
    records = [json.loads(line) for line in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all(r["rewound"] for r in records)
    assert resumed_at(copy, 4)
    # a run that started over rewrites the early records, unmarked
    (copy / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 9)))
    assert not resumed_at(copy, 4)
