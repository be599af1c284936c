"""Step guards: skip the optimizer step on a loss spike, stop after too many skipped steps in a row.

Both are fed the global-batch loss, the same number on every rank, so every rank reaches the same
decision without a collective of its own. Both are Stateful: a resumed run decides exactly as the run
never stopped would.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful

# Fewer accepted losses give a standard deviation too noisy to judge a spike by.
MIN_STEPS_TO_JUDGE = 8


class TooManySkippedSteps(RuntimeError):
    """Training skipped max_consecutive_skips optimizer steps in a row; the message names the fix."""


class NonFiniteHeldOutLoss(RuntimeError):
    """The weights give a non-finite held-out loss: training on cannot mend them (every step would be skipped)."""


class LossSpikeGuard(Stateful):
    """A loss is a spike when it exceeds mean + zscore * std of the last `window` accepted losses.

    No loss is judged before MIN_STEPS_TO_JUDGE accepted losses (or the whole window, if smaller).
    A spike's loss is not added to the statistics, so a run of spikes cannot drag the threshold up.
    """

    def __init__(self, zscore: float, window: int):
        if zscore <= 0 or window < 1:
            raise ValueError(f"LossSpikeGuard needs zscore > 0 and window >= 1, got {zscore} and {window}")
        self.zscore, self.window = zscore, window
        self.losses: deque[float] = deque(maxlen=window)

    @property
    def ready(self) -> bool:
        return len(self.losses) >= min(MIN_STEPS_TO_JUDGE, self.window)

    def threshold(self) -> float:
        """The loss above which a step is a spike (inf until enough steps were accepted)."""
        if not self.ready:
            return math.inf
        return statistics.fmean(self.losses) + self.zscore * statistics.pstdev(self.losses)

    def is_spike(self, loss: float) -> bool:
        return loss > self.threshold()

    def __call__(self, loss: float) -> bool:
        """True (skip this step) on a spike; otherwise the loss joins the statistics."""
        if self.is_spike(loss):
            return True
        if math.isfinite(loss):
            self.losses.append(loss)
        return False

    def describe(self, loss: float) -> str:
        """One phrase on how far `loss` is from the recent ones, for log lines and errors."""
        mean, std = statistics.fmean(self.losses), statistics.pstdev(self.losses)
        return f"loss {loss:.4g} vs {mean:.4g} +- {std:.2g} over the last {len(self.losses)} accepted steps"

    # Fixed-shape tensors: DCP loads in place, so the saved tensors must match the ones given to load.
    def state_dict(self) -> dict[str, Any]:
        history = torch.zeros(self.window, dtype=torch.float64)
        history[: len(self.losses)] = torch.tensor(list(self.losses), dtype=torch.float64)
        return {"losses": history, "count": torch.tensor(len(self.losses))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        count = int(state_dict["count"])
        self.losses = deque(state_dict["losses"][:count].tolist(), maxlen=self.window)


class ConsecutiveSkips(Stateful):
    """Counts skipped optimizer steps in a row and stops training when there are too many."""

    def __init__(self, limit: int):
        self.limit = limit
        self.count = 0

    def update(self, step: int, skip_reason: str | None, detail: str = "") -> None:
        """Count a skipped step (skip_reason given; an applied step resets the count); raise
        TooManySkippedSteps when the count reaches the limit."""
        self.count = self.count + 1 if skip_reason is not None else 0
        if self.count < self.limit:
            return
        detail = f", {detail}" if detail else ""
        raise TooManySkippedSteps(
            f"step {step}: {self.count} optimizer steps in a row were skipped (last: {skip_reason}{detail}): "
            f"lower optim.lr, resume from an earlier checkpoint, "
            f"or raise resilience.spike_zscore / resilience.max_consecutive_skips"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"count": torch.tensor(self.count)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.count = int(state_dict["count"])
