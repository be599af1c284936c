"""The verbs that take a run directory, on a one-step tiny run: export's file modes, generate's context note."""

from __future__ import annotations

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
