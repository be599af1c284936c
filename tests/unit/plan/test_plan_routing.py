"""`optimus plan --moe-routing RUN`: the expert counts a run logged, priced at each layout's own expert split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from optimus.cli import main
from optimus.config import load_config
from optimus.parallel.mesh import ParallelDims
from optimus.plan.routing import LOGGED_STEPS, LoggedRouting, RoutingError, layout_imbalance
from tests.helpers.runs import one_error_line

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
MOE = CONFIGS / "mula-tiny-moe.yaml"  # 4 layers of 16 experts
PLAN = ["plan", str(MOE), "--cluster", "h100", "--devices", "8"]


def _config(*overrides: str):
    return load_config(MOE, list(overrides))


def _dims(ep: int = 1, tp: int = 1, pp: int = 1) -> ParallelDims:
    return ParallelDims(dp_replicate=1, dp_shard=ep, tp=tp, pp=pp, ep=ep, world_size=ep * tp * pp)


def _write_run(folder: Path, steps: list[list[list[int]]]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": i + 1, "loss": 1.0, "expert_counts": counts}) for i, counts in enumerate(steps)]
    lines.insert(1, json.dumps({"step": 1, "eval_loss": 2.0}))  # records without counts are passed over
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _layer(*per_expert: int) -> list[int]:
    return list(per_expert) + [1] * (16 - len(per_expert))


def test_each_layout_gets_the_share_its_own_split_of_the_experts_had():
    # layer 0: expert 0 takes 17 of 32 copies; layers 1-3 even; the second step even everywhere
    skewed, even = [_layer(17)] + [[2] * 16] * 3, [[2] * 16] * 4  # 32 copies a layer
    routing = LoggedRouting(torch.tensor([skewed, even], dtype=torch.float64), "run")
    config = _config()
    # one rank holds every expert: nothing to wait for
    assert layout_imbalance(routing, config, _dims()) == ({0: 1.0}, 1.0)
    # ep 2: layer 0's first block has 17 + 7 of 32 copies (1.5x); the step waits for it in layer 0 only, the
    # layers' mean (1.5 + 3) / 4 in the skewed step and 1.0 in the even one: the mean over steps
    kept, paced = layout_imbalance(routing, config, _dims(ep=2))
    assert paced == pytest.approx(((1.5 + 3) / 4 + 1.0) / 2)
    # the activations: the first block's copies summed over the layers, 24 + 3 x 16 of 128 (1.125x), worst step
    assert kept == pytest.approx({0: (24 + 48) / 64})
    # 16 shards of one expert each: 17 copies of an even 2 in layer 0 (8.5x); tp splits the same way as ep
    kept, paced = layout_imbalance(routing, config, _dims(ep=4, tp=4))
    assert paced == pytest.approx(((8.5 + 3) / 4 + 1.0) / 2) and kept[0] == pytest.approx((17 + 6) / 8)
    # pp 2: each stage its own layers (the first holds layer 0); the step waits for the slower stage
    kept, paced = layout_imbalance(routing, _config("--parallel.pp=2"), _dims(ep=2, pp=2))
    assert kept == pytest.approx({0: (24 + 16) / 32, 1: 1.0})
    assert paced == pytest.approx(((1.5 + 1) / 2 + 1.0) / 2)
    # one block recomputed at a time (full checkpointing): the worst layer's share, not the sum
    kept, _ = layout_imbalance(routing, _config("--train.activation_checkpointing=full"), _dims(ep=2))
    assert kept == pytest.approx({0: 1.5})
    # --moe-imbalance's one figure, as given, for every layout
    assert layout_imbalance(1.3, config, _dims(ep=2)) == (1.3, 1.3)
    assert layout_imbalance(1.3, config, _dims()) == (1.0, 1.0)  # where it cannot wait for another shard


def test_a_run_folder_or_its_metrics_file_is_read_and_only_its_last_logged_steps_count(tmp_path):
    even, skewed = [[2] * 16] * 4, [_layer(17)] * 4
    run = _write_run(tmp_path / "run", [skewed] + [even] * LOGGED_STEPS)
    for source in (run, run / "metrics.jsonl"):
        routing = LoggedRouting.read(source)
        assert routing.steps == LOGGED_STEPS and routing.source == str(source)
        assert layout_imbalance(routing, _config(), _dims(ep=2)) == ({0: 1.0}, 1.0)  # the skewed first step is past
    routing.check_model(_config())


@pytest.mark.parametrize("steps, overrides, message", [
    (None, [], "{run}: no such run folder or file (give a run folder `optimus train` wrote, or its metrics.jsonl)"),
    ("folder", [], "{run}: no {metrics} (give a run folder"),
    ([], [], "{metrics} logged no expert counts (a dense model's run, or one stopped before its first logged step)"),
    ([[[1, 2], [3]]], [], "{run}: its expert_counts are not [layer][expert] counts of one shape"),
    ([[[2] * 15 + [-1]] * 4], [], "{run}: its expert_counts are not [layer][expert] counts of one shape"),
    ([[[2] * 15 + [float("nan")]] * 4], [], "{run}: its expert_counts are not [layer][expert] counts of one shape"),
    ([[[2] * 15 + [float("inf")]] * 4], [], "{run}: its expert_counts are not [layer][expert] counts of one shape"),
    ([[[2] * 8] * 4], [], "logged 4 layers of 8 experts; this model has 4 of 16: give a run of the same model shape, "
                          "or --moe-imbalance X"),
    ([[[2] * 16] * 3], [], "logged 3 layers of 16 experts; this model has 4 of 16"),
    ([[[2] * 16] * 4], ["--model.n_experts=0"], "--moe-routing prices an MoE's routing: this config's model is dense"),
])
def test_a_run_that_cannot_price_this_plan_is_refused_in_one_line(tmp_path, steps, overrides, message):
    run = tmp_path / "run"
    if steps == "folder":
        run.mkdir()
    elif steps is not None:
        _write_run(run, steps)
    with pytest.raises(RoutingError) as caught:
        LoggedRouting.read(run).check_model(_config(*overrides))
    said = str(caught.value)
    assert message.format(run=run, metrics=run / "metrics.jsonl") in said and "\n" not in said


def _plan(*flags: str, out: Path) -> dict[str, dict]:
    assert main([*PLAN, *flags, "--json", str(out)]) == 0
    return {json.dumps(e["layout"], sort_keys=True): e for e in json.loads(out.read_text())}


def test_plan_at_a_runs_routing_prices_each_layout_at_its_own_split(tmp_path, capsys):
    """Routing that gives every split 1.5x (the first half of each block's experts take three copies, the second
    half one) plans exactly as --moe-imbalance 1.5; one hot expert costs the layouts with more shards more."""
    halves = [[3] * 8 + [1] * 8] * 4
    assert _plan("--moe-routing", str(_write_run(tmp_path / "halves", [halves] * 3)), out=tmp_path / "a.json") == \
        _plan("--moe-imbalance", "1.5", out=tmp_path / "b.json")
    assert "priced at the routing" in capsys.readouterr().out
    hot = [_layer(9)] * 4  # 24 copies: 2 shards 16 of an even 12, 16 shards 9 of an even 1.5
    planned = _plan("--moe-routing", str(_write_run(tmp_path / "hot", [hot])), out=tmp_path / "c.json")
    balanced = _plan(out=tmp_path / "d.json")
    at_two = _plan("--moe-imbalance", str(16 / 12), out=tmp_path / "e.json")
    seen, grew = set(), {"memory_gib": 0, "step_time_s": 0}
    for key, entry in planned.items():
        shards = entry["layout"]["ep"] * entry["layout"]["tp"]
        seen.add(shards)
        if shards == 1:
            assert entry == balanced[key]
        elif shards == 2:
            assert entry == at_two[key]
        else:  # 4 shards: 12 copies of an even 6 (2x); 8: 9 of 3 (3x) (a launch-bound tiny step may not show it)
            for field in grew:
                assert entry[field] >= at_two[key][field], (entry["layout"], field)
                grew[field] += entry[field] > at_two[key][field]
    assert {1, 2, 4, 8} <= seen and min(grew.values()) > 20, (seen, grew)


def test_plan_takes_one_routing_flag_and_a_readable_run(tmp_path, capsys):
    assert main([*PLAN, "--moe-routing", str(tmp_path), "--moe-imbalance", "1.2"]) == 2
    assert "--moe-routing and --moe-imbalance both price the routing: give one" in one_error_line(capsys)
    assert main([*PLAN, "--moe-routing", str(tmp_path / "nowhere")]) == 2
    assert f"--moe-routing {tmp_path / 'nowhere'}: no such run folder or file" in one_error_line(capsys)


@pytest.mark.parametrize("checkpointing, kept", [("full", 1.5), ("selective", 1.5), ("selective_ops", 1.125),
                                                 ("none", 1.125)])
def test_where_blocks_are_recomputed_one_at_a_time_the_worst_layer_sets_the_activations(checkpointing, kept):
    """Full and selective checkpointing keep one block's routed activations at a time (layer 0's busiest half: 24 of
    32 copies, 1.5x); selective_ops and none keep every layer's, summed: (24 + 3 x 16) / 64 = 1.125x."""
    skewed = [_layer(17)] + [[2] * 16] * 3
    routing = LoggedRouting(torch.tensor([skewed], dtype=torch.float64), "run")
    config = _config(f"--train.activation_checkpointing={checkpointing}")
    assert layout_imbalance(routing, config, _dims(ep=2))[0] == pytest.approx({0: kept})


def test_records_beyond_the_last_logged_steps_are_passed_over():
    """The router settles as training goes on: of more records than LOGGED_STEPS, the last ones count."""
    even, skewed = [[2] * 16] * 4, [_layer(17)] * 4
    records = [{"expert_counts": skewed}] + [{"expert_counts": even}] * LOGGED_STEPS
    routing = LoggedRouting.of_records(records, "run")
    assert routing.steps == LOGGED_STEPS and bool((routing.counts == 2).all())


def test_virtual_stages_set_without_a_pipeline_split_nothing():
    """pp_virtual_stages counts only under pp > 1 (as validate_layout reads it): a one-layer model with it set to 2
    and no pipeline is one stage of its one layer, priced as such."""
    routing = LoggedRouting(torch.tensor([[_layer(17)]], dtype=torch.float64), "run")
    config = _config("--model.n_layers=1", "--parallel.pp_virtual_stages=2")
    kept, paced = layout_imbalance(routing, config, _dims(ep=2))
    assert kept == pytest.approx({0: 1.5}) and paced == pytest.approx(1.5)


def test_the_routing_line_gives_the_fuller_stages_activations():
    """Under pp 2 the first stage holds the skewed layer 0 (its busiest half 1.25x over the stage's layers), the last
    stage even ones (1.0x): the line gives the larger."""
    from optimus.parallel.validate import validate_layout
    from optimus.plan.report import describe_routing
    from optimus.plan.search import Candidate

    routing = LoggedRouting(torch.tensor([[_layer(17)] + [[2] * 16] * 3], dtype=torch.float64), "run")
    config = validate_layout(_config("--parallel.dp_shard=2", "--parallel.ep=2", "--parallel.pp=2"), 4).config
    line = describe_routing(routing, Candidate(config, True, 1.0, 0.5, 1e5, 0.3, {"compute": 0.5}))
    assert line.endswith("its activations at 1.25x in the worst step")
