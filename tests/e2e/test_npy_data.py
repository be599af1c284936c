"""Training on OLMo/Dolma token files (headerless .npy) mixed with our own tokenized data, end to end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml

from optimus.cli import main
from tests.e2e.conftest import tiny_config


def losses(run_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_npy_mixture_trains_and_resumes_to_identical_losses(tmp_path, token_dir):
    # the speeches' ids as AI2 ships OLMoE-mix: uint32, no header, several files, EOS 50279 between documents
    ids = np.fromfile(token_dir / "train.bin", dtype=np.uint16)
    (tmp_path / "npy").mkdir()
    for k, part in enumerate(np.array_split(ids, 2)):
        part.astype(np.uint32).tofile(tmp_path / "npy" / f"part-{k}-00000.npy")
    sources = [{"glob": str(tmp_path / "npy" / "*.npy"), "dtype": "uint32", "eos_id": 50279, "weight": 2.0},
               {"path": str(token_dir), "weight": 1.0}]
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(tiny_config(token_dir, data={"sources": sources},
                                                 train={"max_steps": 4, "ckpt_every": 2, "eval_every": 2})))

    assert main(["train", str(config), f"--run.dir={tmp_path / 'straight'}", "--no-progress"]) == 0
    assert main(["train", str(config), f"--run.dir={tmp_path / 'resumed'}", "--train.max_steps=2", "--no-progress"]) == 0
    assert main(["train", str(config), f"--run.dir={tmp_path / 'resumed'}", "--no-progress"]) == 0

    straight, resumed = losses(tmp_path / "straight"), losses(tmp_path / "resumed")
    assert sorted(straight) == [1, 2, 3, 4] and all(np.isfinite(list(straight.values())))
    assert resumed == straight  # same batches after the restart, so the same losses to the last bit
