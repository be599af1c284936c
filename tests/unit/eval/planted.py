"""A model whose answers are known, for the downstream scorer's tests: see test_scoring.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from optimus.eval.tasks import Question
from optimus.models.transformer import ModelOutput

VOCAB = 128


class CharTokenizer:
    """One token per character (its code point), the interface of a `tokenizers.Tokenizer`."""

    def encode(self, text: str, add_special_tokens: bool = False):
        return SimpleNamespace(ids=[ord(ch) for ch in text])


class SuccessorModel(nn.Module):
    """logits[t] favour token input[t] + 1 by `strength` (negative: disfavour it)."""

    def __init__(self, strength: float):
        super().__init__()
        self.strength = strength

    def forward(self, input_ids: torch.Tensor) -> ModelOutput:
        successor = torch.nn.functional.one_hot((input_ids + 1) % VOCAB, VOCAB).float()
        return ModelOutput(logits=self.strength * successor)


# Gold is never index 0, so a scorer that ranks ties (e.g. reads the wrong positions) to index 0 loses.
QUESTIONS = [
    Question(contexts=("abc",) * 3, continuations=("xq", "zzz", "defg"), gold=2),
    Question(contexts=("klm",) * 2, continuations=("nmk", "nop"), gold=1),
    Question(contexts=("Question: pqr",) * 4, continuations=("stuvwxz", "sa", "zz", "stuvwxy"), gold=3),
    # WinoGrande-style: the contexts differ, the continuation is the same
    Question(contexts=("gh", "ab"), continuations=("cde", "cde"), gold=1),
]
