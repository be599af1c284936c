"""An exported run carries its tokenizer: AutoTokenizer loads it offline, and transformers' greedy text
equals `optimus generate`'s, for an MoE (OLMoE) and a dense (OLMo-2) model."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")

from optimus.cli import main  # noqa: E402
from tests.e2e.conftest import tiny_config  # noqa: E402

PROMPT = "The United States"
DENSE = {"n_experts": 0, "ffn_hidden": 128, "norm_placement": "post"}


@pytest.mark.parametrize("model", [{}, DENSE], ids=["moe", "dense"])
def test_export_loads_with_its_tokenizer_and_generates_the_same_text(model, tmp_path, token_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    cfg = tmp_path / "c.yaml"
    raw = tiny_config(token_dir, model=model, train={"max_steps": 3, "ckpt_every": 3, "eval_every": 0})
    cfg.write_text(yaml.safe_dump(raw))
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", str(cfg), f"--run.dir={run}", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
    prompt_line, continuation_line = capsys.readouterr().out.splitlines()
    ours = prompt_line.removeprefix("prompt: ") + continuation_line.split("): ", 1)[1]
    assert main(["export", str(run), "--format", "hf", "--out", str(out)]) == 0
    assert "with its tokenizer" in capsys.readouterr().out

    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        assert (out / name).is_file(), name
    tokenizer = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert len(tokenizer) == 50280 and tokenizer.eos_token_id == 50279 and tokenizer.pad_token_id == 1
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == 50279
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    inputs = tokenizer(PROMPT, return_tensors="pt")
    with torch.no_grad():
        generated = hf_model.generate(**inputs, max_new_tokens=12)  # greedy: generation_config.json
    theirs = tokenizer.decode(generated[0], skip_special_tokens=True)
    assert theirs == ours
