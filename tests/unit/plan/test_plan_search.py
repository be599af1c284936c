"""The layout search proposes only what the trainer accepts; `optimus plan` end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import load_cluster
from optimus.plan.search import plan

REPO = Path(__file__).resolve().parents[3]


def test_every_proposed_layout_passes_validate_layout():
    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    candidates = plan(config, load_cluster("h100"), 8)
    assert len(candidates) > 20
    assert {c.config.parallel.ep for c in candidates} >= {1, 2, 4}  # EP is searched
    assert {c.config.parallel.pp for c in candidates} >= {1, 2, 4}
    for c in candidates:
        layout = validate_layout(c.config, 8)  # raises if the trainer would refuse it
        assert layout.dims.world_size == 8 and layout.batch.micro_batch_size == c.config.train.micro_batch_size
    fitting = [c.step_s for c in candidates if c.fits]
    assert fitting == sorted(fitting) and candidates[0].fits


def test_a_layout_fits_only_within_the_headroom_of_device_memory():
    """A plan keeps 10% of device memory free (dry_run.HEADROOM: the allocator's fragmentation, the launcher's and
    the communication library's own buffers): a layout needing 95% of a device does not fit, one needing 85% does."""
    from dataclasses import replace

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    best = plan(config, load_cluster("h100"), 8)[0]
    for share, fits in ((0.95, False), (0.85, True)):
        cluster = replace(load_cluster("h100"), memory_gb=best.memory_bytes / share / 1024**3)
        (same,) = [c for c in plan(config, cluster, 8) if c.config == best.config]
        assert same.memory_bytes == best.memory_bytes and same.fits is fits, share


def test_forked_workers_price_the_same_ranking_as_one_process():
    """A large search is priced over forked workers, in runs of CHUNK layouts: the candidates, their order and every
    JSON field are what one process gives (the configs rebuilt from each layout equal the ones priced)."""
    from optimus.plan import search

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    cluster = load_cluster("h100")
    alone, forked = plan(config, cluster, 8, workers=1), plan(config, cluster, 8, workers=2)
    assert len(alone) > 2 * search.CHUNK  # more than one run of layouts each worker takes
    assert [c.config for c in forked] == [c.config for c in alone]
    assert [c.entry(cluster, 1e9) for c in forked] == [c.entry(cluster, 1e9) for c in alone]


def test_only_a_large_search_forks(monkeypatch):
    from optimus.plan import search

    monkeypatch.setattr(search.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    assert search.pricing_workers(search.FORK_ABOVE) == 1  # faster priced than workers start
    assert search.pricing_workers(search.FORK_ABOVE + 1) == -(-(search.FORK_ABOVE + 1) // search.CHUNK)
    assert search.pricing_workers(10**6) == search.MAX_WORKERS
    monkeypatch.setattr(search.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert search.pricing_workers(10**6) == 1


def _plan(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "optimus", "plan", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def test_plan_cli_writes_ranked_json_and_the_best_config(tmp_path):
    out, best = tmp_path / "plan.json", tmp_path / "best.yaml"
    done = _plan(str(REPO / "configs" / "mula-tiny-moe.yaml"), "--cluster", "h100", "--devices", "8", "--tokens",
                 "1e9", "--json", str(out), "--write-config", str(best), "--top", "5", "--train.global_batch_size=16",
                 cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "valid layouts of 8 h100 devices" in done.stdout
    # the energy table: LUMI's published rows, then this plan's, in the same columns
    assert "Gopher-280B" in done.stdout and "OLMo-7B" in done.stdout and "this plan: 1B tokens" in done.stdout
    entries = json.loads(out.read_text())
    keys = {"dp_replicate", "dp_shard", "tp", "pp", "ep", "micro_batch_size", "grad_accum", "activation_checkpointing",
            "shard_mode", "pp_schedule"}
    for e in entries:
        assert keys <= set(e["layout"])
        assert {"fits", "memory_gib", "step_time_s", "tokens_per_s", "mfu", "days", "energy_mwh", "co2_t"} <= set(e)
        assert 0 < e["mfu"] < 1 and e["tokens_per_s"] > 0
        # IT energy is nodes x node power x time; carbon that times the PUE and the grid's intensity (LUMI's table)
        assert e["co2_t"] == pytest.approx(e["energy_mwh"] * 1.1 * 0.385)
        assert abs(e["tokens_per_s"] * e["days"] * 86400 - 1e9) < 1e3
        # the terms add up to the totals: the peak stage's memory, the step's time
        assert sum(e["memory_parts_gib"].values()) == pytest.approx(e["memory_gib"])
        assert e["memory_parts_gib"]["activations"] > 0 and e["memory_parts_gib"]["parameters"] > 0
    # and the best fitting layout's terms are printed under the table, largest first
    memory_line = next(line for line in done.stdout.splitlines() if line.startswith("#1 memory per device"))
    parts = entries[0]["memory_parts_gib"]
    largest = max(parts, key=parts.get)
    assert f"{entries[0]['memory_gib']:.1f} GiB: {largest} {parts[largest]:.1f} GiB" in memory_line
    step_line = next(line for line in done.stdout.splitlines() if line.startswith("#1 step, "))
    slowest = max(entries[0]["step_parts_s"], key=entries[0]["step_parts_s"].get)
    assert step_line.startswith(f"#1 step, {entries[0]['step_time_s']:.3f} s: {slowest} ")
    written = load_config(best)
    top = entries[0]["layout"]
    p = written.parallel
    assert (p.dp_replicate, p.dp_shard, p.tp, p.pp, p.ep) == tuple(top[k] for k in ("dp_replicate", "dp_shard", "tp",
                                                                                     "pp", "ep"))
    assert written.train.micro_batch_size == top["micro_batch_size"]
    validate_layout(written, 8)


def test_plan_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    # main() in this process (the CLI less ~5 s of interpreter and torch start-up per case); the test above
    # runs `optimus plan` as a real process
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "mula-tiny-moe.yaml")
    for args, needle in ((["--cluster", "nowhere", "--devices", "8"], "unknown cluster 'nowhere'"),
                         (["--cluster", "aurora", "--devices", "16"], "not a multiple of the 12 devices")):
        capsys.readouterr()
        assert main(["plan", config, *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_plan_on_gpus_says_what_compiling_would_give_and_not_when_compiled(monkeypatch, tmp_path, capsys):
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "mula-1b.yaml")
    args = ["plan", config, "--cluster", "h200", "--devices", "8", "--top", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    hint = [line for line in out.splitlines() if "--train.compile=true" in line]
    assert len(hint) == 1 and "x faster" in hint[0], hint
    assert main([*args, "--train.compile=true"]) == 0
    assert "--train.compile=true the best layout" not in capsys.readouterr().out


def test_plan_cli_hints_bf16_gradient_reduction_only_where_the_config_reduces_in_fp32(monkeypatch, tmp_path, capsys):
    # a 7B MoE over 64 Frontier GCDs with one sequence each: its expert gradients' sync is not hidden, so bf16 pays
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["plan", str(REPO / "configs" / "mula-7b-a1b.yaml"), "--cluster", "frontier", "--devices", "64", "--top",
            "1", "--train.global_batch_size=64", "--only", "tp=1", "--only", "pp=1"]  # a tenth of the search
    assert main([*args, "--parallel.grad_reduce_dtype=fp32"]) == 0
    hint = [line for line in capsys.readouterr().out.splitlines() if "--parallel.grad_reduce_dtype=bf16" in line]
    assert len(hint) == 1 and "x faster" in hint[0], hint
    assert main(args) == 0  # the recipe reduces in bf16 already
    assert "--parallel.grad_reduce_dtype=bf16" not in capsys.readouterr().out


def test_plan_says_what_bf16_gradient_reduction_would_give(capsys):
    from optimus.cli.plan import hint_setting
    from optimus.config import load_config
    from optimus.plan.cluster import load_cluster
    from optimus.plan.search import plan

    cluster = load_cluster("frontier")
    config = load_config(REPO / "configs" / "mula-1b.yaml", ["--parallel.grad_reduce_dtype=fp32"])
    # zero1 reduce-scatters its gradients at the step, where nothing hides them
    best = next(c for c in plan(config, cluster, 64) if c.fits and c.config.parallel.shard_mode == "zero1")
    bf16 = dict(section="parallel", field="grad_reduce_dtype", value="bf16", why="half the bytes")
    hint_setting(best, cluster, None, 1.0, min_speedup=1.0, **bf16)
    (line,) = capsys.readouterr().out.splitlines()
    assert line.startswith("with --parallel.grad_reduce_dtype=bf16 the best layout is predicted ")
    faster = float(line.split("(")[1].split("x faster")[0])
    assert faster > 1.0 and line.endswith("half the bytes")
    hint_setting(best, cluster, None, 1.0, min_speedup=faster + 0.01, **bf16)
    assert capsys.readouterr().out == ""  # below the speedup asked for: nothing said


def test_plan_at_another_scale_with_its_own_batch_needs_no_degrees(monkeypatch, tmp_path, capsys):
    # mula-1b's recipe is data parallel over 3,072 ranks: a 64-sequence batch does not divide over them, but the
    # plan chooses the degrees, so planning 64 devices with it works (and says why the recipe's layout was dropped)
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    config = str(REPO / "configs" / "mula-1b.yaml")
    assert main(["plan", config, "--cluster", "frontier", "--devices", "64", "--top", "1",
                 "--train.global_batch_size=64"]) == 0
    captured = capsys.readouterr()
    assert "note: the config's own layout does not hold" in captured.err and "best 1" in captured.out
    # a config wrong in another way still fails as written: one line, exit 2
    assert main(["plan", config, "--cluster", "frontier", "--devices", "64", "--train.global_batch_size=0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "global_batch_size" in err


def test_a_search_held_to_some_values_is_the_whole_search_filtered():
    from optimus.plan.search import parse_only

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    cluster = load_cluster("h100")
    only = parse_only(["tp=1", "shard_mode=zero1,zero2", "pp_schedule=gpipe", "ep_dispatch=allgather"])
    held = plan(config, cluster, 8, only=only)

    def keeps(layout):  # schedules only where there is a pipeline, dispatch only where there are experts to send to
        return (layout["tp"] == 1 and layout["shard_mode"] in ("zero1", "zero2") and
                layout["pp_schedule"] in ("gpipe", "none") and layout["ep_dispatch"] in ("allgather", "none"))
    whole = [c.layout() for c in plan(config, cluster, 8)]
    assert [c.layout() for c in held] == [lay for lay in whole if keeps(lay)]
    assert {c.config.parallel.pp for c in held} >= {1, 2} and {c.config.parallel.ep for c in held} >= {1, 2}
    accum = plan(config, cluster, 8, only=parse_only(["grad_accum=2"]))
    assert accum and {c.layout()["grad_accum"] for c in accum} == {2}


@pytest.mark.parametrize("spec,needle", [
    ("tp", "write KEY=V1[,V2...]"), ("shard=fsdp", "with KEY one of dp_replicate"), ("tp=", "write KEY=V1"),
    ("tp=0", "'0' is not a value it takes (positive integers)"), ("tp=two", "'two' is not a value"),
    ("shard_mode=zero3", "'zero3' is not a value it takes (fsdp, zero1, zero2, ddp)"),
])
def test_a_restriction_that_cannot_be_read_is_named(spec, needle):
    from optimus.config import ConfigError
    from optimus.plan.search import parse_only

    with pytest.raises(ConfigError) as err:
        parse_only([spec])
    assert needle in str(err.value)


def test_a_restriction_given_twice_is_refused():
    from optimus.config import ConfigError
    from optimus.plan.search import parse_only

    with pytest.raises(ConfigError, match="given twice"):
        parse_only(["tp=1", "tp=2"])


def test_plan_cli_only_keeps_to_the_restriction_and_refuses_a_bad_one(monkeypatch, tmp_path, capsys):
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["plan", str(REPO / "configs" / "mula-tiny-moe.yaml"), "--cluster", "h100", "--devices", "8",
            "--train.global_batch_size=16", "--json", "plan.json"]
    assert main([*args, "--only", "tp=1", "--only", "shard_mode=zero1"]) == 0
    assert "searched only layouts with tp in {1}; shard_mode in {zero1}" in capsys.readouterr().out
    entries = json.loads((tmp_path / "plan.json").read_text())
    assert entries and all((e["layout"]["tp"], e["layout"]["shard_mode"]) == (1, "zero1") for e in entries)
    for bad, needle in ((["--only", "tp=3"], "no layout of 8 devices within --only tp=3"),
                        (["--only", "mode=fsdp"], "--only 'mode=fsdp': write KEY=V1")):
        assert main([*args, "--overwrite", *bad]) == 2  # the plan.json the first search wrote stays
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err and "Traceback" not in err, err


def test_where_nothing_fits_the_layout_closest_to_fitting_is_broken_down(monkeypatch, tmp_path, capsys):
    from optimus.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["plan", str(REPO / "configs" / "mula-220b-a10b.yaml"), "--cluster", "h100", "--devices", "8",
                 "--top", "1", "--train.global_batch_size=8"]) == 0
    out = capsys.readouterr().out
    assert "no layout fits 80 GiB devices" in out
    (line,) = [line for line in out.splitlines() if " memory per device" in line]
    assert line.startswith("#") and "optimizer" in line and "parameters" in line


def test_a_candidates_entry_counts_every_device_of_its_layout_and_memory_in_gib():
    """HSDP 2 x 2 over a 2-stage pipeline is 8 devices (one 10.2 kW h100 node): at 1e5 tokens/s, 8.64e9 tokens take
    a day, 0.2448 MWh; its 16 sequences are 2 micro-batches of 2 on each of the 4 data-parallel ranks (grad_accum 2);
    memory is reported in GiB (2**30 bytes), as device memory is."""
    from optimus.plan.search import Candidate

    cluster = load_cluster("h100")
    config = validate_layout(load_config(REPO / "configs" / "mula-tiny-moe.yaml", [
        "--train.global_batch_size=16", "--parallel.dp_replicate=2", "--parallel.dp_shard=2", "--parallel.pp=2",
        "--train.micro_batch_size=2"]), 8).config
    candidate = Candidate(config, True, 3 * 2**30, 0.5, 1e5, 0.3, {"compute": 0.5}, None, {"parameters": 2**30})
    assert candidate.config_world() == 8
    entry = candidate.entry(cluster, 8.64e9)
    assert entry["layout"]["grad_accum"] == 2 and entry["layout"]["pp_schedule"] == "1f1b"
    assert entry["memory_gib"] == 3.0 and entry["memory_parts_gib"] == {"parameters": 1.0}
    assert entry["days"] == pytest.approx(1.0) and entry["energy_mwh"] == pytest.approx(0.2448)


def _layouts(devices: int, batch: int, only: list[str], cluster: str = "h100") -> list:
    from optimus.plan.search import parse_only

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", [f"--train.global_batch_size={batch}"])
    return plan(config, load_cluster(cluster), devices, only=parse_only(only))


def test_every_micro_batch_up_to_sixteen_that_divides_a_ranks_share_is_tried():
    """128 sequences over 8 data-parallel ranks: 16 a rank, in micro-batches of 1, 2, 4, 8 or 16."""
    found = _layouts(8, 128, ["tp=1", "pp=1", "ep=1", "activation_checkpointing=none", "shard_mode=fsdp"])
    assert sorted(c.config.train.micro_batch_size for c in found) == [1, 2, 4, 8, 16]


def test_one_data_parallel_rank_is_one_row_not_one_per_shard_mode():
    """tp 4 x pp 2 on 8 devices leaves one data-parallel rank: fsdp, zero1, zero2 and ddp would run alike."""
    found = _layouts(8, 16, ["tp=4", "pp=2", "micro_batch_size=1", "activation_checkpointing=none",
                             "pp_schedule=1f1b"])
    assert [c.config.parallel.shard_mode for c in found] == ["fsdp"]


def test_hsdp_groups_span_a_node_or_the_expert_parallel_ranks_if_wider():
    """64 h100s at tp 4 leave 16 data-parallel ranks; a node holds 2 of them, but ep 4 needs its 4 experts' holders
    in one FSDP group: HSDP groups of 4 (x 4 replicas) beside FSDP over all 16."""
    found = _layouts(64, 64, ["tp=4", "pp=1", "ep=4", "micro_batch_size=1", "activation_checkpointing=none",
                              "shard_mode=fsdp", "ep_dispatch=all_to_all"])
    assert sorted((c.config.parallel.dp_replicate, c.config.parallel.dp_shard) for c in found) == [(1, 16), (4, 4)]


def test_a_layouts_routing_price_is_its_fuller_stages():
    """With a run's routing each pipeline stage has its own activations' share: the candidate reports the larger."""
    import torch

    from optimus.plan.routing import LoggedRouting, layout_imbalance
    from optimus.plan.search import parse_only

    skewed, even = [[17] + [1] * 15] + [[2] * 16] * 3, [[2] * 16] * 4  # layer 0 (the first stage's) skewed
    routing = LoggedRouting(torch.tensor([skewed, even], dtype=torch.float64), "run")
    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    (found,) = plan(config, load_cluster("h100"), 8, only=parse_only([
        "tp=1", "pp=2", "ep=2", "micro_batch_size=1", "activation_checkpointing=none", "shard_mode=fsdp",
        "pp_schedule=1f1b", "ep_dispatch=all_to_all"]), routing=routing)
    kept, paced = layout_imbalance(routing, found.config, found.dims())
    assert kept[0] > kept[1] and found.moe_imbalance == (kept[0], paced)


def test_a_pool_worker_prices_its_search_itself(monkeypatch):
    """A daemonic process (a multiprocessing pool's own worker, as a search run from one is) may not start
    processes: however large its search, it prices the layouts itself."""
    import types

    from optimus.plan import search

    monkeypatch.setattr(search.os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setattr(search.multiprocessing, "current_process", lambda: types.SimpleNamespace(daemon=True))
    assert search.pricing_workers(10**6) == 1


def test_the_largest_machine_planned_is_refused_one_device_past_it(monkeypatch):
    """--devices past MAX_DEVICES is refused before any layout is enumerated, from the first device too many
    (MAX_DEVICES lowered to 15 here, so that 16 H100s, two whole nodes, are that device)."""
    from optimus.config import ConfigError
    from optimus.plan import search

    monkeypatch.setattr(search, "MAX_DEVICES", 15)
    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--model.n_layers=2"])
    with pytest.raises(ConfigError, match="--devices 16 is more than the 15 devices the planner searches"):
        plan(config, load_cluster("h100"), 16)


def test_layouts_that_fit_come_first_however_fast_the_others_are_predicted():
    """The ranking puts every fitting layout (fastest first) before any that does not fit, though a layout too large
    for the memory (no activation checkpointing, a larger micro-batch) is predicted faster than fitting ones."""
    from dataclasses import replace

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--model.n_layers=2", "--train.seq_len=64"])
    out = plan(config, replace(load_cluster("h100"), devices_per_node=2, memory_gb=0.5), 2)
    fitting, too_large = [c for c in out if c.fits], [c for c in out if not c.fits]
    assert fitting and too_large and min(c.step_s for c in too_large) < max(c.step_s for c in fitting)
    assert out == fitting + too_large
    assert [c.step_s for c in fitting] == sorted(c.step_s for c in fitting)


def test_tensor_parallelism_spans_up_to_a_whole_node_and_no_further():
    """tp takes every degree dividing the heads up to a node's devices, that many included: the tiny MoE's 4 heads
    on 4-device nodes reach tp 4; on 2-device nodes (two nodes, the same 4 devices) tp stops at 2."""
    from dataclasses import replace

    from optimus.plan.search import _variants

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    for per_node, tps in ((4, {1, 2, 4}), (2, {1, 2})):
        cluster = replace(load_cluster("h100"), devices_per_node=per_node)
        assert {parallel["tp"] for parallel, _ in _variants(config, 4, cluster)} == tps, per_node


def test_a_layout_needing_exactly_the_usable_memory_fits(monkeypatch):
    """A layout fits where its memory is at most the device's usable share, that much included (HEADROOM raised to
    1 here, and the device made exactly the best layout's size, so that no rounding stands between them)."""
    from dataclasses import replace

    from optimus.plan import search

    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--train.global_batch_size=16"])
    only = search.parse_only(["tp=1", "pp=1", "ep=1", "micro_batch_size=1", "activation_checkpointing=none",
                              "shard_mode=fsdp"])
    (best,) = plan(config, load_cluster("h100"), 8, only=only)
    monkeypatch.setattr(search, "HEADROOM", 1.0)
    cluster = replace(load_cluster("h100"), memory_gb=best.memory_bytes / 1024**3)
    assert cluster.memory_bytes == best.memory_bytes
    (same,) = plan(config, cluster, 8, only=only)
    assert same.memory_bytes == best.memory_bytes and same.fits


def test_an_integer_restriction_is_read_as_its_number():
    """`--only tp=01,2` holds the search to tp 1 and 2: the values are compared as the numbers they name."""
    from optimus.plan.search import parse_only, within

    only = parse_only(["tp=01,2", "shard_mode=zero1"])
    assert only == {"tp": frozenset({"1", "2"}), "shard_mode": frozenset({"zero1"})}
    parallel = dict(dp_replicate=1, dp_shard=8, tp=1, pp=1, ep=1, shard_mode="zero1")
    assert within(only, parallel, {"micro_batch_size": 1}, 16)


def test_the_largest_machine_planned_is_planned(monkeypatch):
    """--devices MAX_DEVICES itself is searched (MAX_DEVICES lowered to 16 here: two whole h100 nodes)."""
    from optimus.plan import search

    monkeypatch.setattr(search, "MAX_DEVICES", 16)
    config = load_config(REPO / "configs" / "mula-tiny-moe.yaml", ["--model.n_layers=2",
                                                                   "--train.global_batch_size=16"])
    only = search.parse_only(["tp=1", "pp=1", "ep=1", "micro_batch_size=1", "activation_checkpointing=none"])
    assert plan(config, load_cluster("h100"), 16, only=only)


@pytest.mark.parametrize("mode, label", [("selective", "selective (moe+attention)"), ("full", "full"),
                                         ("selective_ops", "selective_ops"), ("none", "none")])
def test_a_layouts_checkpointing_names_the_recomputed_modules_only_under_selective(mode, label):
    """train.recompute says what selective checkpointing runs again; the other modes ignore it and say nothing of it."""
    from optimus.plan.search import Candidate

    config = validate_layout(load_config(REPO / "configs" / "mula-tiny-moe.yaml", [
        "--train.global_batch_size=16", f"--train.activation_checkpointing={mode}",
        "--train.recompute=[moe,attention]"]), 1).config
    candidate = Candidate(config, True, 2**30, 0.5, 1e5, 0.3, {"compute": 0.5})
    assert candidate.layout()["activation_checkpointing"] == label


def test_a_grad_accum_restriction_counts_every_data_parallel_rank():
    """16 sequences over HSDP 2 x 4 in micro-batches of 2: one micro-batch a rank (grad_accum 1), not two."""
    from optimus.plan.search import parse_only, within

    parallel = dict(dp_replicate=2, dp_shard=4, tp=1, pp=1, ep=1)
    assert within(parse_only(["grad_accum=1"]), parallel, {"micro_batch_size": 2}, 16)
    assert not within(parse_only(["grad_accum=2"]), parallel, {"micro_batch_size": 2}, 16)
