"""`optimus import` of a Hugging Face OLMoE folder, then `optimus export` of that run, through the real CLI."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from optimus.cli import main  # noqa: E402

VOCAB = 512


def _tiny_hf_olmoe():
    config = transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_experts=8, num_experts_per_tok=2, pad_token_id=1, eos_token_id=VOCAB - 1,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    with torch.no_grad():  # non-unit norms, so that a misplaced norm would show in the logits
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
    return model.eval()


def test_import_then_export_round_trips_through_the_cli(tmp_path, capsys):
    original = _tiny_hf_olmoe()
    original.save_pretrained(tmp_path / "hf-in")
    run, exported = tmp_path / "runs" / "imported", tmp_path / "hf-out"

    assert main(["import", str(tmp_path / "hf-in"), "--out", str(run)]) == 0
    assert (run / "config.yaml").is_file()
    assert main(["export", str(run), "--format", "hf", "--out", str(exported)]) == 0
    # the context travels too: OlmoeConfig's max_position_embeddings (4096) -> train.seq_len -> config.json
    assert original.config.max_position_embeddings == 4096
    assert "train.seq_len 4096 from config.json's max_position_embeddings" in capsys.readouterr().out
    assert json.loads((exported / "config.json").read_text())["max_position_embeddings"] == 4096

    reloaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        exported, attn_implementation="sdpa", output_loading_info=True
    )
    assert type(reloaded).__name__ == "OlmoeForCausalLM"
    assert not any(info.values()), info
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (reloaded(ids).logits - original(ids).logits).abs().max().item() <= 1e-5

    # Importing again into a run that already holds checkpoints must not overwrite them.
    capsys.readouterr()
    assert main(["import", str(tmp_path / "hf-in"), "--out", str(run)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().err


def test_import_of_a_pickle_only_folder_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    _tiny_hf_olmoe().config.to_json_file(tmp_path / "hf" / "config.json")
    (tmp_path / "hf" / "pytorch_model.bin").write_bytes(b"never unpickled")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "safetensors" in err
