"""The Mula recipes carry the published training set-up and pass the dry run at the published device count."""

from __future__ import annotations

from pathlib import Path

import pytest

from optimus.config import load_config
from tests.helpers.distributed import run_forked

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
# the published layouts on 3,072 Aurora tiles (REFERENCE.md): (dp_shard, ep, pp, recompute)
PUBLISHED = {
    "mula-1b": (3072, 1, 1, None),
    "mula-7b-a1b": (3072, 1, 1, None),
    "mula-20b-a2b": (3072, 12, 1, None),
    "mula-100b-a7b": (768, 12, 4, ["moe"]),
    "mula-220b-a10b": (384, 12, 8, ["moe", "attention", "norms"]),
}
TOKENS = {"mula-1b": 4e12, "mula-7b-a1b": 4e12, "mula-20b-a2b": 100e9, "mula-100b-a7b": 100e9, "mula-220b-a10b": 100e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_has_the_published_setup(name):
    config = load_config(CONFIGS / f"{name}.yaml")
    t, o, p = config.train, config.optim, config.parallel
    assert config.model.preset == name
    assert (t.seq_len, t.global_batch_size, t.dtype) == (2048, 3072, "auto")
    assert t.max_steps == round(TOKENS[name] / (3072 * 2048))
    assert (o.lr, o.min_lr, o.warmup_steps, o.schedule, o.weight_decay, o.betas, o.eps) == (
        4e-4, 4e-5, 2500, "cosine", 0.1, (0.9, 0.95), 1e-8)
    assert o.grad_clip == 1.0 and o.clip_after_warmup
    dp_shard, ep, pp, recompute = PUBLISHED[name]
    assert (p.dp_shard, p.ep, p.pp, p.tp, p.shard_mode) == (dp_shard, ep, pp, 1, "zero1")
    if recompute:
        assert t.activation_checkpointing == "selective" and sorted(t.recompute) == sorted(recompute)
    if config.model.is_moe:
        assert (config.model.aux_loss_coef, config.model.z_loss_coef) == (0.01, 0.001)
    assert t.ckpt_every == (500 if TOKENS[name] > 1e12 else 250)


def _dry_run_fits(name: str) -> list[bool]:
    from optimus.parallel.dry_run import dry_run

    report = dry_run(load_config(CONFIGS / f"{name}.yaml"), world_size=3072, device_memory_gb=64.0)
    return [rank.total <= 0.9 * 64 * 1024**3 for rank in report.ranks]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_recipe_fits_64_gb_tiles_at_its_published_layout(name):
    fits = run_forked(_dry_run_fits, name, timeout=240)
    assert fits and all(fits), f"{name} does not fit a 64 GB tile at its published layout: {fits}"
