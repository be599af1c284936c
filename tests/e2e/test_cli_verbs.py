"""The verbs a user runs after training: eval, generate, info, train --dry-run."""

from __future__ import annotations

import re

import pytest
import yaml

from optimus.cli import main
from tests.e2e.conftest import tiny_config


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, token_dir):
    tmp = tmp_path_factory.mktemp("run")
    cfg = tmp / "c.yaml"
    # loss.png on (tiny_config switches it off): this run is the one that proves it is drawn
    cfg.write_text(yaml.safe_dump(tiny_config(token_dir, train={"max_steps": 4, "ckpt_every": 4, "eval_every": 0,
                                                                "loss_plot": True})))
    assert main(["train", str(cfg), f"--run.dir={tmp / 'run'}", "--no-progress"]) == 0
    return tmp / "run"


def test_train_prints_summary_and_writes_run_dir(trained_run, capsys):
    assert (trained_run / "config.yaml").exists() and (trained_run / "loss.png").exists()
    records = [yaml.safe_load(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    step_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in step_records] == [1, 2, 3, 4]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_seen", "tokens_per_s", "mfu", "aux_loss", "z_loss",
                "expert_load_max", "expert_load_min"):
        assert key in step_records[-1], key
    assert step_records[-1]["tokens_seen"] == 4 * 8 * 64
    assert any("eval_loss" in r for r in records)


def test_eval_prints_loss_perplexity_bits_per_byte(trained_run, token_dir, capsys):
    assert main(["eval", str(trained_run), "--data", str(token_dir), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    match = re.search(r"loss ([\d.]+)\s+perplexity ([\d.]+)\s+bits/byte ([\d.]+)", out)
    assert match, out
    loss, ppl, bpb = map(float, match.groups())
    assert abs(ppl - 2.718281828 ** loss) / ppl < 1e-3 and 0 < bpb < 20


def test_generate_is_greedy_and_deterministic(trained_run, capsys):
    assert main(["generate", str(trained_run), "--prompt", "The Constitution", "--max-new-tokens", "5"]) == 0
    first = capsys.readouterr().out
    assert main(["generate", str(trained_run), "--prompt", "The Constitution", "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == first and first.strip()


def test_info_lists_every_preset_without_allocating(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("mula-1b", "mula-7b-a1b", "mula-20b-a2b", "mula-100b-a7b", "mula-220b-a10b", "olmoe-1b-7b"):
        assert name in out
    assert "6.9" in out and "220." in out


def test_info_of_one_preset_shows_only_that_preset(capsys):
    assert main(["info", "mula-220b-a10b"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "mula-" in line or "olmoe" in line]
    assert len(rows) == 1 and "mula-220b-a10b" in rows[0] and "220." in rows[0]


def test_info_takes_model_overrides_as_train_and_plan_do(capsys):
    assert main(["info", "mula-tiny-moe", "--model.n_layers=8"]) == 0  # a preset, changed
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "config" in line]
    assert "│      8 │" in row and "MoE top-4" in row
    assert main(["info", "--model.preset=mula-1b"]) == 0  # the preset named by override, not every preset
    out = capsys.readouterr().out
    assert "config" in out and "1.28B" in out and "mula-220b" not in out
    assert main(["info", "--model.preset=nosuch"]) == 2  # no longer ignored
    assert "unknown model.preset 'nosuch'" in capsys.readouterr().err


def test_generate_echoes_the_prompt_then_the_continuation(trained_run, capsys):
    assert main(["generate", str(trained_run), "--prompt", "The Constitution", "--max-new-tokens", "3"]) == 0
    prompt, continuation = capsys.readouterr().out.splitlines()
    assert prompt == "prompt: The Constitution"
    assert continuation.startswith("continuation (3 tokens, greedy): ")


def test_dry_run_prints_resolved_config(tmp_path, token_dir, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(tiny_config(token_dir)))
    assert main(["train", str(cfg), "--dry-run", "--train.max_steps=77"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["train"]["max_steps"] == 77 and resolved["model"]["d_model"] == 64


@pytest.mark.parametrize("env, expected", [
    ({}, "optimus"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "optimus launch --nproc-per-node 2"),
    ({"RANK": "0", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"}, "[16 ranks through torchrun, as this job was started]"),
])
def test_the_printed_resume_command_relaunches_every_rank(env, expected, monkeypatch):
    """After a run of several ranks, `optimus train ...` alone would start one process and refuse the layout."""
    from optimus.cli.train import _relaunch_prefix

    for name in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "PMI_RANK", "PALS_RANKID",
                 "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert _relaunch_prefix().startswith(expected)
