"""Per-data-parallel-rank batches from a Mixture, resumable exactly from a one-number state.

Global batch s is samples [s * G, (s + 1) * G) of the mixture. Rank r of D takes the contiguous
slice [s * G + r * G / D, s * G + (r + 1) * G / D) and splits it into micro-batches. Because the
samples depend only on their index, the state is just the step: resuming at any number of ranks
gives the very batches an uninterrupted run would have seen, and the ranks' slices, concatenated
in rank order, are exactly the single-process batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

import numpy as np
import torch

from optimus.data.dataset import TokenDataset
from optimus.data.errors import DataError
from optimus.data.mixture import Mixture

MicroBatch = tuple[torch.Tensor, torch.Tensor]  # (inputs [mb, seq_len], labels [mb, seq_len]), int64


def check_token_ids(windows: np.ndarray, vocab_size: int | None, what: str) -> None:
    """Refuse ids the model has no embedding row for (a damaged token file, or one made with another tokenizer):
    the embedding would fail mid-step with an IndexError. One pass over this batch's ids on the host."""
    if vocab_size is None or not windows.size:
        return
    largest = int(windows.max())
    if largest >= vocab_size or int(windows.min()) < 0:
        bad = largest if largest >= vocab_size else int(windows.min())
        raise DataError(f"{what} holds token id {bad}, outside model.vocab_size {vocab_size}: a token file is damaged "
                        "or was made with another tokenizer: re-run `optimus tokenize` on it with the run's tokenizer")


def _split_inputs_and_labels(windows: np.ndarray) -> MicroBatch:
    """[n, seq_len + 1] windows -> (inputs w[:, :-1], labels w[:, 1:]) as contiguous LongTensors."""
    tokens = torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class BatchLoader:
    """This rank's micro-batches of each global batch; `state_dict()` is `{"step": int}`."""

    def __init__(
        self,
        mixture: Mixture,
        global_batch_size: int,
        micro_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        vocab_size: int | None = None,
    ):
        """Check that the global batch divides evenly into ranks and micro-batches; with `vocab_size`, every batch's
        token ids are checked against it."""
        if global_batch_size < 1 or micro_batch_size < 1:
            raise DataError(
                f"batch sizes must be positive (global {global_batch_size}, micro {micro_batch_size}): fix the config"
            )
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise DataError(f"data-parallel rank {dp_rank} of {dp_size} is invalid: check the launch settings")
        if global_batch_size % dp_size:
            raise DataError(
                f"global batch size {global_batch_size} is not divisible by the {dp_size} data-parallel ranks: "
                f"use a multiple of {dp_size}"
            )
        per_rank = global_batch_size // dp_size
        if per_rank % micro_batch_size:
            raise DataError(
                f"each of the {dp_size} ranks gets {per_rank} samples, not divisible by micro batch size "
                f"{micro_batch_size}: choose a micro batch size that divides {per_rank}"
            )
        self.mixture = mixture
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.samples_per_rank = per_rank
        self.vocab_size = vocab_size
        self.step = 0

    @property
    def seq_len(self) -> int:
        """Tokens per input row."""
        return self.mixture.seq_len

    def sample_range(self, step: int) -> range:
        """Global sample indices this rank reads at `step`."""
        start = step * self.global_batch_size + self.dp_rank * self.samples_per_rank
        return range(start, start + self.samples_per_rank)

    def batch_at(self, step: int) -> list[MicroBatch]:
        """This rank's micro-batches of global batch `step` (a pure function of seed and step)."""
        windows = np.stack([self.mixture.sample(i) for i in self.sample_range(step)])
        check_token_ids(windows, self.vocab_size, f"training batch {step + 1}")
        return [
            _split_inputs_and_labels(windows[start : start + self.micro_batch_size])
            for start in range(0, self.samples_per_rank, self.micro_batch_size)
        ]

    def next_batch(self) -> list[MicroBatch]:
        """The micro-batches of the next global batch; advances the step."""
        batch = self.batch_at(self.step)
        self.step += 1
        return batch

    def __iter__(self):
        """Endless iteration over next_batch()."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        """What a checkpoint needs to resume: the number of global batches already consumed."""
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        """Resume after `state["step"]` global batches (at any dp_size, same global batch size)."""
        step = state.get("step") if isinstance(state, dict) else None
        if isinstance(step, torch.Tensor) and step.numel() == 1:  # some checkpointers tensorize ints
            step = int(step.item())
        if not isinstance(step, (int, np.integer)) or step < 0:
            raise DataError(f"data loader state {state!r} has no valid step: resume from another checkpoint")
        self.step = int(step)


def heldout_batches(
    datasets: Sequence[TokenDataset], seq_len: int, batch_size: int, n_batches: int, vocab_size: int | None = None
) -> list[MicroBatch]:
    """Fixed evaluation batches: the first windows of each held-out set, taken round-robin.

    Window 0 of every source, then window 1 of every source, and so on (a source with fewer
    windows drops out); at most n_batches batches of batch_size, the last one possibly smaller.
    The same inputs give the same batches every time, so evaluation losses are comparable.
    An empty `datasets` (no source has a held-out split) gives an empty list.
    """
    if batch_size < 1 or n_batches < 1:
        raise DataError(f"eval batch size {batch_size} and batch count {n_batches} must be positive: fix the config")
    windows = _heldout_windows(datasets, seq_len, batch_size * n_batches, vocab_size)
    return [_split_inputs_and_labels(windows[start : start + batch_size]) for start in range(0, len(windows), batch_size)]


def heldout_share(
    datasets: Sequence[TokenDataset], seq_len: int, global_batch_size: int, n_batches: int, micro_batch_size: int,
    dp_rank: int = 0, dp_size: int = 1, vocab_size: int | None = None,
) -> list[MicroBatch]:
    """This data-parallel rank's share of the training loop's held-out set, in micro-batches.

    The set is the first n_batches x global_batch_size windows taken as `heldout_batches` takes them (fewer where
    the held-out data is shorter: then a multiple of dp_size), the same whatever the layout; rank r of D holds its
    contiguous 1/D of them, so every rank runs the same number of forwards (a sharded model's are collective) and
    the ranks' sums of losses and tokens add up to the one-process set's.
    """
    if global_batch_size < 1 or n_batches < 1 or micro_batch_size < 1:
        raise DataError(f"eval batches {n_batches} of {global_batch_size} sequences (micro {micro_batch_size}) must be "
                        "positive: fix the config")
    windows = _heldout_windows(datasets, seq_len, global_batch_size * n_batches, vocab_size)
    share = len(windows) // dp_size
    mine = windows[dp_rank * share : (dp_rank + 1) * share]
    return [_split_inputs_and_labels(mine[start : start + micro_batch_size])
            for start in range(0, share, micro_batch_size)]


def _heldout_windows(datasets: Sequence[TokenDataset], seq_len: int, wanted: int, vocab_size: int | None) -> np.ndarray:
    """The first `wanted` held-out windows: window 0 of every source, then window 1 of every source, and so on."""
    if not datasets:
        return np.empty((0, seq_len + 1), dtype=np.int64)  # no source has a held-out split: callers skip evaluation
    counts = [ds.num_instances(seq_len) for ds in datasets]
    round_robin = ((k, i) for i in range(max(counts)) for k in range(len(datasets)) if i < counts[k])
    order = list(islice(round_robin, wanted))
    windows = np.stack([datasets[k].instance(i, seq_len) for k, i in order])
    check_token_ids(windows, vocab_size, "the held-out data")
    return windows
