"""The verbs that take a run directory, on a one-step tiny run: export's file modes and context length, generate's
context note; and import, which takes its train.seq_len from config.json's max_position_embeddings."""

from __future__ import annotations

import json
import os
import stat

import pytest

from optimus.cli import main

PROMPT = "The United States"
SEQ_LEN = 32  # tiny_run_config's train.seq_len


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, small_token_dir):
    """A one-step dense run that exports as Llama (pre-norm, no QK-norm)."""
    from optimus.config import build_config
    from optimus.train.trainer import Trainer
    from tests.helpers.runs import tiny_run_config

    run = tmp_path_factory.mktemp("tiny") / "run"
    raw = tiny_run_config(run, small_token_dir, model=dict(qk_norm=False),
                          train=dict(max_steps=1, ckpt_every=1, eval_every=0))
    Trainer(build_config(raw), progress_bar=False).fit()
    return run


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_export_files_and_folders_get_the_umask_modes(umask, tiny_run, tmp_path, capsys):
    out = tmp_path / "shared" / "hf"  # its parent is made too
    before = os.umask(umask)
    try:
        assert main(["export", str(tiny_run), "--format", "hf", "--out", str(out)]) == 0, capsys.readouterr().err
    finally:
        os.umask(before)
    for folder in (out.parent, out):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o777 & ~umask, folder
    files = sorted(out.iterdir())
    assert out / "model.safetensors" in files and out / "tokenizer.json" in files
    for path in files:
        assert oct(stat.S_IMODE(path.stat().st_mode)) == oct(0o666 & ~umask), path.name


def test_export_states_the_context_the_run_trained_at(tiny_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["export", str(tiny_run), "--format", "hf", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == SEQ_LEN
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == SEQ_LEN


def _hf_folder(tmp_path, **config_changes):
    """A tiny Llama-layout HF folder written by our own export, its config.json edited (a value of ... drops a key)."""
    from optimus.models.config import ModelConfig
    from optimus.models.hf import export_hf
    from optimus.models.transformer import build_model
    from tests.helpers.hf import edit_hf_config

    model = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_experts=0, ffn_hidden=64, vocab_size=128, qk_norm=False)
    folder = export_hf(build_model(model, seed=0), model, tmp_path / "hf")
    edit_hf_config(folder, **config_changes)
    return folder


@pytest.mark.parametrize("context", [4096, 1536])
def test_import_trains_at_max_position_embeddings_and_export_keeps_it(context, tmp_path, capsys):
    from optimus.config import load_config

    run, back = tmp_path / "run", tmp_path / "back"
    assert main(["import", str(_hf_folder(tmp_path, max_position_embeddings=context)), "--out", str(run)]) == 0
    line = capsys.readouterr().out.strip()
    assert f"(step 0, train.seq_len {context} from config.json's max_position_embeddings)" in line
    assert line.endswith("(add --train.seq_len=N for another context)")
    assert load_config(run / "config.yaml").train.seq_len == context  # and the config still validates
    assert main(["export", str(run), "--format", "hf", "--out", str(back)]) == 0
    assert json.loads((back / "config.json").read_text())["max_position_embeddings"] == context


@pytest.mark.parametrize("absent", [..., None])  # ...: the key dropped
def test_import_without_max_position_embeddings_keeps_the_default_seq_len(absent, tmp_path, capsys):
    from optimus.config import TrainConfig, load_config

    default, run = TrainConfig().seq_len, tmp_path / "run"
    assert main(["import", str(_hf_folder(tmp_path, max_position_embeddings=absent)), "--out", str(run)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and f"(step 0, train.seq_len {default}, the default)" in captured.out
    assert load_config(run / "config.yaml").train.seq_len == default


# a string and a zero; tests/unit/models/test_hf_bad_input.py has every kind
@pytest.mark.parametrize("value, shown", [("4096", '"4096"'), (0, "0")])
def test_import_refuses_a_malformed_max_position_embeddings_in_one_line(value, shown, tmp_path, capsys):
    from tests.helpers.runs import one_error_line

    run = tmp_path / "run"
    assert main(["import", str(_hf_folder(tmp_path, max_position_embeddings=value)), "--out", str(run)]) == 2
    assert one_error_line(capsys).endswith(
        f"error: config.json field max_position_embeddings must be a positive whole number (got {shown}): set it to "
        "the context the model was trained at, or delete it and pass --train.seq_len=N to optimus train")
    assert not run.exists()


def test_generate_notes_a_continuation_past_the_trained_context(tiny_run, capsys):
    from optimus.data.sources import load_tokenizer

    prompt_tokens = len(load_tokenizer("olmoe").encode(PROMPT).ids)
    fits = SEQ_LEN - prompt_tokens
    assert main(["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", str(fits)]) == 0
    assert capsys.readouterr().err == ""
    assert main(["generate", str(tiny_run), "--prompt", PROMPT, "--max-new-tokens", str(fits + 1)]) == 0
    captured = capsys.readouterr()
    assert captured.err == (f"note: prompt ({prompt_tokens} tokens) + {fits + 1} new tokens exceeds the seq_len "
                            f"{SEQ_LEN} the model was trained on (train.seq_len); text past it is extrapolated\n")
    assert captured.out.startswith(f"prompt: {PROMPT}\ncontinuation (")  # generated all the same


def test_eval_limit_without_tasks_is_one_line(tiny_run, capsys):
    assert main(["eval", str(tiny_run), "--limit", "3", "--batches", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["optimus eval: error: --limit counts the questions of --tasks: add --tasks, or use --batches for "
                   "the held-out loss"]


def test_export_includes_a_tokenizer_exactly_as_large_as_the_models_vocabulary(tiny_run, tmp_path, monkeypatch,
                                                                              capsys):
    """Every id of a tokenizer whose vocabulary is the model's own size has its embedding row: the export ships
    the tokenizer (only a tokenizer with more ids than the model is left out)."""
    from optimus.config import load_config
    from optimus.data import sources

    vocab = load_config(tiny_run / "config.yaml").model.vocab_size
    real = sources.tokenizer_info
    monkeypatch.setattr(sources, "tokenizer_info", lambda spec: {**real(spec), "vocab_size": vocab})
    out = tmp_path / "hf"
    assert main(["export", str(tiny_run), "--format", "hf", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip().endswith("(Hugging Face transformers layout with its tokenizer)")
    assert (out / "tokenizer.json").is_file()
