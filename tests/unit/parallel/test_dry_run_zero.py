"""The dry run under parallel.shard_mode zero1/zero2: whole parameters, owned optimizer-state segments."""

from __future__ import annotations

import pytest

from optimus.config import build_config
from optimus.parallel.dry_run import dry_run
from tests.helpers import in_forked_process

TRAIN = dict(seq_len=4096, micro_batch_size=1, global_batch_size=1536, dtype="bf16", activation_checkpointing="full")


@in_forked_process  # builds a fake process group: keep it out of this process
def test_zero1_counts_whole_parameters_and_ep_aware_owned_state():
    """mula-20b-a2b at dp_shard 384 x ep 12: zero1 keeps whole bf16 weights; EP-aware sharding of the
    non-expert state over all 384 ranks (not the 32 of expert_dp) holds less optimizer state per rank."""
    optimizer_bytes, parameter_bytes = {}, {}
    for aware in (True, False):
        parallel = dict(dp_shard=384, ep=12, shard_mode="zero1", ep_aware=aware)
        config = build_config({"model": {"preset": "mula-20b-a2b"}, "parallel": parallel, "train": TRAIN})
        rank = dry_run(config, 384).ranks[0]
        optimizer_bytes[aware] = rank.bytes["optimizer (master + AdamW, owned segments)"]
        parameter_bytes[aware] = rank.bytes["parameters (whole, bf16)"]
        assert "FSDP transient" not in rank.bytes
    assert parameter_bytes[True] == parameter_bytes[False] == 2 * rank.parameters
    assert optimizer_bytes[True] < 0.8 * optimizer_bytes[False]
    fsdp = build_config({"model": {"preset": "mula-20b-a2b"}, "parallel": dict(dp_shard=384, ep=12), "train": TRAIN})
    fsdp_rank = dry_run(fsdp, 384).ranks[0]
    # the same owned elements as FSDP's shards (12 B each: fp32 master + two moments), up to padding
    fsdp_state = fsdp_rank.bytes["optimizer (AdamW, 2 x fp32)"] + fsdp_rank.bytes["parameters (fp32)"]
    assert optimizer_bytes[True] == pytest.approx(fsdp_state, rel=0.05)


@in_forked_process
def test_ddp_counts_whole_replicas_and_its_gradient_buckets():
    """shard_mode ddp at dp 4: every rank holds the whole model, its gradients, AdamW state and DDP's bucket copy."""
    model = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_experts": 0, "ffn_hidden": 128, "vocab_size": 256}
    train = dict(seq_len=64, global_batch_size=8, dtype="fp32")
    config = build_config({"model": model, "parallel": dict(dp_shard=4, shard_mode="ddp"), "train": train})
    rank = dry_run(config, 4).ranks[0]
    from optimus.models.transformer import build_model

    whole = sum(p.numel() for p in build_model(config.model, device="meta").parameters())
    assert rank.parameters == whole
    assert rank.bytes["DDP gradient buckets (fp32)"] == rank.bytes["gradients (fp32)"] == 4 * whole
    assert "FSDP transient" not in rank.bytes
