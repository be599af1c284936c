"""Tiny training runs for tests: a small tokenized corpus and a CPU-sized Trainer config over it.

    token_dir = tokenize_small_corpus(tmp_path / "tokens")
    raw = tiny_run_config(tmp_path / "run", token_dir, train=dict(max_steps=4, ckpt_every=2))
    Trainer(build_config(raw)).fit()

The corpus is the first three packaged State of the Union speeches, tokenized with the OLMoE
tokenizer (a fifth of the shards held out for evaluation). The config is a raw dict (ready for
`build_config` or for writing out as YAML): a one-layer dense model, sequences of 32 tokens, one
micro-batch of 2 per step, one evaluation batch. Tests add the settings they are about.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

SMALL_CORPUS_DOCUMENTS = 3


def tokenize_small_corpus(out_dir: str | Path) -> Path:
    """Tokenizes the first three State of the Union speeches (OLMoE tokenizer) into `out_dir`; returns it."""
    from optimus.data.sources import iter_packaged_documents
    from optimus.data.tokenize import tokenize_documents

    out = Path(out_dir)
    documents = [doc for _, doc in zip(range(SMALL_CORPUS_DOCUMENTS), iter_packaged_documents("sotu"))]
    tokenize_documents(documents, "olmoe", out, heldout_fraction=0.2, workers=1, progress=False)
    return out


def tiny_run_config(
    run_dir: str | Path,
    token_dir: str | Path,
    *,
    train: dict | None = None,
    resilience: dict | None = None,
    model: dict | None = None,
    parallel: dict | None = None,
) -> dict[str, Any]:
    """The raw config of a tiny run in `run_dir` over the tokens in `token_dir`.

    Defaults: model d_model 32, 1 layer, 2 heads, dense (ffn_hidden 64); train seq_len 32, micro and
    global batch 2, eval_batches 1, fp32 (so no test depends on
    whether this CPU has native bf16), no report page (~2 s of plotting; tests/unit/report asks for it), no
    loss.png (~0.2 s a checkpoint; tests/e2e/test_cli_verbs.py draws it). Each section dict given is merged over its defaults; resilience
    and parallel are left out unless given.
    """
    raw: dict[str, Any] = {
        "model": {**dict(d_model=32, n_layers=1, n_heads=2, n_experts=0, ffn_hidden=64, vocab_size=50304),
                  **(model or {})},
        "train": {**dict(seq_len=32, micro_batch_size=2, global_batch_size=2, eval_batches=1, dtype="fp32",
                                 report=False, loss_plot=False), **(train or {})},
        "data": dict(sources=[dict(path=str(token_dir))]),
        "run": dict(dir=str(run_dir)),
    }
    if resilience is not None:
        raw["resilience"] = dict(resilience)
    if parallel is not None:
        raw["parallel"] = dict(parallel)
    return raw


def small_moe_trainer_config(run_dir: str, max_steps: int, parallel: dict):
    """A built Config: a two-layer MoE (8 experts, top 2) on the packaged speeches, checkpointing every 2 steps,
    with the `parallel` settings given (resharding and sharded-optimizer resume tests)."""
    from optimus.config import build_config

    return build_config({
        "model": dict(d_model=64, n_layers=2, n_heads=4, n_experts=8, top_k=2, expert_ffn_hidden=64),
        "train": dict(seq_len=32, micro_batch_size=2, global_batch_size=8, max_steps=max_steps, eval_batches=2,
                      ckpt_every=2, dtype="fp32"),
        "optim": dict(lr=3e-3, warmup_steps=1, schedule="constant"),
        "data": dict(sources=[dict(name="sotu")]),
        "run": dict(dir=run_dir),
        "parallel": parallel,
    })


def train_small_moe_on_rank(rank: int, world: int, run_dir: str, max_steps: int, parallel: dict) -> None:
    """(one rank of run_distributed) the Trainer on small_moe_trainer_config, as torchrun would start it."""
    import os

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    from optimus.train.trainer import Trainer

    Trainer(small_moe_trainer_config(run_dir, max_steps, parallel), progress_bar=False).fit()


def one_error_line(capsys) -> str:
    """The one line a CLI command printed on stderr (no traceback), from pytest's capsys."""
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]
