"""Typed settings of the guards that keep a long run alive (the `resilience:` config section)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ResilienceConfig(BaseModel):
    """Loss-spike guard, hang watchdog, straggler report and preemption signals. 0 turns a guard off."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    spike_zscore: float = Field(
        0.0, ge=0, description="skip the optimizer step when the loss exceeds the running mean of recent "
                               "losses by this many running standard deviations (0 = off; 6 is a common choice)")
    spike_window: int = Field(50, ge=8, description="recent accepted steps the spike statistics are taken over")
    max_consecutive_skips: int = Field(
        5, gt=0, description="stop with an error after this many skipped steps in a row (non-finite or spikes)")
    hang_timeout_s: float = Field(
        0.0, ge=0, description="abort with every thread's stack when no step finishes for this long, so the "
                               "launcher restarts the job (0 = off)")
    straggler_every: int = Field(0, ge=0, description="compare the ranks' step times every N steps (0 = off)")
    straggler_factor: float = Field(1.5, gt=1, description="a rank slower than this times the median is reported")
    checkpoint_on_signal: bool = Field(
        True, description="on SIGTERM or SIGUSR1 (preemption, a job's time limit), checkpoint at the next step "
                          "boundary and exit cleanly; a rerun resumes from there")
