"""train/evaluate.py's summary figures of a held-out loss, by hand."""

from __future__ import annotations

import math

import pytest

from optimus.train.evaluate import EvalResult


def test_bits_per_byte_is_the_total_nats_in_bits_over_the_bytes():
    # 1,000 tokens at 2 nats each decode to 4,000 bytes: 2,000 nats = 2,885.4 bits over 4,000 bytes
    result = EvalResult(loss=2.0, tokens=1000, bytes=4000)
    assert result.bits_per_byte == pytest.approx(2000 / math.log(2) / 4000)
    assert result.perplexity == pytest.approx(math.exp(2.0))
    assert EvalResult(loss=2.0, tokens=1000).bits_per_byte is None  # the bytes are not known
