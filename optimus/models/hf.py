"""State-dict mapping to and from Hugging Face OLMoE, OLMo-2 and Llama layouts."""

from __future__ import annotations


class InteropError(ValueError):
    """A Hugging Face directory or export request that cannot be honoured (one-line message)."""
