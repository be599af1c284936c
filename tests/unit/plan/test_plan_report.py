"""The planner's outputs (optimus/plan/report.py): the ranked table, its breakdown of one layout, and the lines that
say what the scaling and the routing gave. Candidates are built by hand here, so each figure printed is known."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from optimus.parallel.validate import validate_layout
from optimus.plan.cluster import load_cluster
from optimus.plan.report import breakdown, describe_scaling, format_table, layout_summary
from optimus.plan.scaling import SmallerRun
from optimus.plan.search import Candidate

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
GIB = 1024**3


def _candidate(overrides: list[str], fits: bool, gib: float, step_s: float, tokens_per_s: float = 1e5,
               world: int = 8) -> Candidate:
    config = validate_layout(load_config(CONFIGS / "mula-tiny-moe.yaml", ["--train.global_batch_size=16",
                                                                          *overrides]), world).config
    return Candidate(config, fits, gib * GIB, step_s, tokens_per_s, 0.25, {"compute": step_s * 0.75,
                     "optimizer": step_s * 0.25}, None, {"parameters": gib / 4 * GIB, "activations": gib * 3 / 4 * GIB})


def _rows(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines() if line[:3].strip().isdigit()]


def test_the_table_counts_the_layouts_that_fit_and_shows_memory_in_gib():
    """The headline counts every valid layout and, apart, those that fit; memory is in GiB as device memory is
    (an "80 GB" H100 holds 80 GiB), so 12 GiB prints 12.0, not 12.9 (decimal GB)."""
    cluster = load_cluster("h100")
    candidates = [_candidate(["--parallel.dp_shard=8"], True, 12.0, 0.5),
                  _candidate(["--parallel.dp_shard=8", "--parallel.shard_mode=zero1"], True, 20.0, 0.6),
                  _candidate(["--parallel.dp_shard=8", "--parallel.shard_mode=ddp"], False, 90.0, 0.4)]
    table = format_table(candidates, cluster, 8, 2, None)
    assert table.splitlines()[0] == "3 valid layouts of 8 h100 devices (2 fit 80 GiB at 90%); best 2:"
    rows = _rows(table)
    assert len(rows) == 2 and rows[0][:2] == ["1", "1"] and rows[0][12:14] == ["12.0", "yes"]


def test_the_shard_mode_of_a_layout_with_one_data_parallel_rank_is_a_dash():
    """With one data-parallel rank nothing is sharded or replicated: fsdp, zero1 and ddp would be the same run."""
    cluster = load_cluster("h100")
    alone = _candidate(["--parallel.tp=4", "--parallel.pp=2"], True, 10.0, 0.5)
    spread = _candidate(["--parallel.dp_shard=2", "--parallel.tp=4", "--parallel.shard_mode=zero1"], True, 10.0, 0.6)
    (first, second) = _rows(format_table([alone, spread], cluster, 8, 2, None))
    assert first[9] == "-" and second[9] == "zero1"
    assert "fsdp" not in layout_summary(alone) and ", zero1" in layout_summary(spread)


def test_the_energy_columns_are_the_it_energy_and_its_carbon():
    """MWh is nodes x node power x time (LUMI's table counts IT energy, not the facility's); carbon that times the
    PUE and the grid: 8 H100s (one 10.2 kW node) at 1e5 tokens/s for 8.64e9 tokens: 1 day, 0.2448 MWh, 0.104 t."""
    cluster = load_cluster("h100")
    best = _candidate(["--parallel.dp_shard=8"], True, 12.0, 0.5)
    table = format_table([best], cluster, 8, 1, 8.64e9)
    (row,) = _rows(table)
    assert row[-3:] == ["1.00", "0.2", "0.1"]
    (ours,) = [line for line in table.splitlines() if line.startswith("this plan")]
    assert ours.split()[-4:] == ["0.245", "1.10", "0.385", "0.104"]


def test_the_breakdown_lists_the_largest_terms_first():
    """What a plan that does not fit, or runs slower than hoped, asks first: where most of it goes."""
    candidate = _candidate(["--parallel.dp_shard=8"], True, 8.0, 0.4)
    memory, step = breakdown(candidate, 3)
    assert memory == "#3 memory per device, 8.0 GiB: activations 6.0 GiB, parameters 2.0 GiB"
    assert step == "#3 step, 0.400 s: compute 0.300 s, optimizer 0.100 s"


def test_where_nothing_fits_the_layout_needing_least_memory_is_broken_down():
    """The layout closest to fitting says what it would take to fit, whatever its rank by step time."""
    cluster = load_cluster("h100")
    fast = _candidate(["--parallel.dp_shard=8"], False, 120.0, 0.4)
    small = _candidate(["--parallel.dp_shard=8", "--parallel.shard_mode=zero1"], False, 95.0, 0.5)
    large = _candidate(["--parallel.dp_shard=8", "--parallel.shard_mode=ddp"], False, 150.0, 0.6)
    lines = format_table([fast, small, large], cluster, 8, 3, None).splitlines()
    assert "#2 memory per device, 95.0 GiB: " in "\n".join(lines)


def test_the_scaling_line_compares_tokens_per_second_per_device():
    """16 devices at 2.4e6 tokens/s (150,000 a device) against 8 at 1.6e6 (200,000 a device): 75.0% of linear."""
    small = _candidate(["--parallel.dp_shard=8"], True, 10.0, 0.5, tokens_per_s=1.6e6)
    big = _candidate(["--parallel.dp_shard=16"], True, 10.0, 0.5, tokens_per_s=2.4e6, world=16)
    line = describe_scaling(SmallerRun(8, "strong", 16, small), big, 16)
    assert line.startswith("strong scaling from 8 to 16 devices: 75.0% of linear (150,000 against 200,000 tokens/s "
                           "per device; global batch held at 16 sequences on 8, whose best layout is dp_shard 8 ")
    assert SmallerRun(8, "strong", 16, small).efficiency(big, 16) == pytest.approx(0.75)


def test_the_routing_line_counts_tensor_parallel_ranks_as_expert_shards():
    """Tensor parallelism splits the experts as ep does (ep x tp shards): under tp 2 alone the busiest shard waits
    for nothing only if one rank held every expert, which it does not. Layer 0's first 8 experts take 24 of 32 token
    copies (1.5x an even share), the other layers are even: the step's mean share (1.5 + 3) / 4 = 1.125x."""
    import torch

    from optimus.plan.report import describe_routing
    from optimus.plan.routing import LoggedRouting

    counts = torch.tensor([[[3] * 8 + [1] * 8] + [[2] * 16] * 3], dtype=torch.float64)
    routing = LoggedRouting(counts, "run")
    line = describe_routing(routing, _candidate(["--parallel.dp_shard=4", "--parallel.tp=2"], True, 1.0, 0.5))
    assert line.endswith("the busiest of the best layout's 2 expert shards (ep x tp) 1.12x its even share of a "
                         "layer's token copies on average, its activations at 1.12x in the worst step")
    alone = describe_routing(routing, _candidate(["--parallel.dp_shard=8"], True, 1.0, 0.5))
    assert alone.endswith("each hold every expert (ep x tp = 1): none waits for another's")


@pytest.mark.parametrize("tokens, text", [(100e9, "100B"), (1e12, "1T"), (2.5e12, "2.5T"), (6.29e6, "6.29M"),
                                          (999.5e9, "999.5B"), (4096, "4.096K"), (500, "500")])
def test_a_token_budget_is_printed_as_plan_tokens_takes_it(tokens, text):
    """What `--tokens` reads back (cli/plan.token_count) is what the energy table's row prints."""
    from optimus.cli.plan import token_count
    from optimus.plan.report import token_text

    assert token_text(tokens) == text
    assert token_count(text) == pytest.approx(tokens, rel=0.01)


def test_the_headline_counts_only_the_rows_there_are_when_top_asks_for_more():
    cluster = load_cluster("h100")
    candidates = [_candidate(["--parallel.dp_shard=8"], True, 12.0, 0.5),
                  _candidate(["--parallel.dp_shard=8", "--parallel.shard_mode=zero1"], True, 20.0, 0.6)]
    table = format_table(candidates, cluster, 8, 5, None)
    assert table.splitlines()[0].endswith("; best 2:") and len(_rows(table)) == 2


def test_the_breakdown_leaves_out_terms_that_round_to_nothing():
    """A term under half the last place printed (0.0 GiB, 0.000 s) says nothing: it is left out."""
    from dataclasses import replace

    candidate = _candidate(["--parallel.dp_shard=8"], True, 8.0, 0.4)
    candidate = replace(candidate, parts={**candidate.parts, "stragglers": 0.0004},
                        memory_parts={**candidate.memory_parts, "buffers": 0.04 * GIB})
    memory, step = breakdown(candidate, 1)
    assert "buffers" not in memory and "stragglers" not in step
    assert step == "#1 step, 0.400 s: compute 0.300 s, optimizer 0.100 s"


def test_a_pipelined_layouts_memory_is_said_to_be_its_fuller_stages():
    """Under pp the memory broken down is one stage's (the first or the last, whichever holds more); without a
    pipeline there is one stage, and nothing to say."""
    piped = breakdown(_candidate(["--parallel.dp_shard=4", "--parallel.pp=2"], True, 8.0, 0.4), 1)[0]
    assert piped.startswith("#1 memory per device (its fuller pipeline stage, first or last), 8.0 GiB: ")
    assert breakdown(_candidate(["--parallel.dp_shard=8"], True, 8.0, 0.4), 1)[0].startswith(
        "#1 memory per device, 8.0 GiB: ")


def test_the_scaling_line_says_a_weak_baselines_batch_was_scaled():
    small = _candidate(["--parallel.dp_shard=8"], True, 10.0, 0.5, tokens_per_s=1.6e6)
    big = _candidate(["--parallel.dp_shard=16"], True, 10.0, 0.5, tokens_per_s=2.4e6, world=16)
    line = describe_scaling(SmallerRun(8, "weak", 8, small), big, 16)
    assert line.startswith("weak scaling from 8 to 16 devices: 75.0% of linear") and (
        "global batch scaled to 8 sequences on 8" in line)


def test_the_json_scores_no_layout_against_a_smaller_run_that_fits_nowhere(tmp_path):
    """Without a fitting smaller run there is nothing to score against: the entries have no scaling_efficiency
    (not a null), as without --scaling-from."""
    import json

    from optimus.plan.report import write_json

    cluster = load_cluster("h100")
    candidate = _candidate(["--parallel.dp_shard=16"], True, 10.0, 0.5, world=16)
    write_json(tmp_path / "plan.json", [candidate], cluster, None, 16, SmallerRun(8, "strong", 16, None))
    (entry,) = json.loads((tmp_path / "plan.json").read_text())
    assert "scaling_efficiency" not in entry


def test_a_layout_summary_names_a_schedule_only_where_there_is_a_pipeline():
    flat = layout_summary(_candidate(["--parallel.dp_shard=8"], True, 1.0, 0.5))
    piped = layout_summary(_candidate(["--parallel.dp_shard=4", "--parallel.pp=2"], True, 1.0, 0.5))
    assert flat.startswith("dp_shard 8 (mbs ") and flat.endswith(", fsdp)")
    assert piped.startswith("dp_shard 4 x pp 2 (mbs ") and piped.endswith(", fsdp, 1f1b)")


def test_where_nothing_fits_no_plan_is_set_beside_the_published_trainings():
    """A layout that does not fit never trains: the energy table compares only a plan that can run."""
    cluster = load_cluster("h100")
    table = format_table([_candidate(["--parallel.dp_shard=8"], False, 120.0, 0.4)], cluster, 8, 1, 8.64e9)
    assert "energy: nodes x 10.2 kW x time" in table
    assert "beside published trainings" not in table and "this plan" not in table
