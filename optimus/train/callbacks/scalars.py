"""The scalar names every metrics logger (TensorBoard, W&B) writes, from the records of metrics.jsonl:
one function per kind of record, so the loggers cannot drift apart."""

from __future__ import annotations

from typing import Any


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A logged step: train/<field> for each number, memory/peak_gib/rank<r> for each rank's peak memory,
    expert_load/layer<l>/max and /min (tokens routed / even share) for each MoE layer."""
    scalars = {f"train/{key}": float(value) for key, value in record.items()
               if key != "step" and isinstance(value, (int, float))}
    for rank, gib in enumerate(record.get("memory_peak_gib", [])):
        scalars[f"memory/peak_gib/rank{rank}"] = float(gib)
    for layer, counts in enumerate(record.get("expert_counts", [])):
        even = sum(counts) / len(counts) if counts else 0
        if even > 0:
            scalars[f"expert_load/layer{layer}/max"] = max(counts) / even
            scalars[f"expert_load/layer{layer}/min"] = min(counts) / even
    return scalars


def eval_scalars(record: dict[str, Any]) -> dict[str, float]:
    """An evaluation: eval/loss, downstream/<task>/acc and /acc_norm."""
    scalars = {"eval/loss": float(record["eval_loss"])} if "eval_loss" in record else {}
    for task, score in record.get("downstream", {}).items():
        scalars[f"downstream/{task}/acc"] = float(score["acc"])
        scalars[f"downstream/{task}/acc_norm"] = float(score["acc_norm"])
    return scalars


def checkpoint_scalars(record: dict[str, Any]) -> dict[str, float]:
    """A committed checkpoint: checkpoint/save_s (start to commit) and checkpoint/blocking_s (training paused)."""
    return {"checkpoint/save_s": float(record["checkpoint_save_s"]),
            "checkpoint/blocking_s": float(record["checkpoint_blocking_s"])}
