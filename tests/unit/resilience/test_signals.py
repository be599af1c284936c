"""PreemptionSignals records SIGTERM and SIGUSR1 instead of dying of them, and puts the previous handlers back."""

from __future__ import annotations

import os
import signal
import threading

import pytest
import torch

from optimus.resilience.signals import PREEMPTION_SIGNALS, PreemptionSignals, signal_name


def remember_call(calls: list):
    def handler(signum, frame):
        calls.append(signum)
    return handler


@pytest.fixture
def previous_handlers():
    """Python handlers of our own in place of the defaults, so a signal that slips through cannot kill pytest."""
    calls: list[int] = []
    handlers = {signum: remember_call(calls) for signum in PREEMPTION_SIGNALS}
    saved = {signum: signal.signal(signum, handler) for signum, handler in handlers.items()}
    yield handlers, calls
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_is_recorded_and_the_previous_handlers_are_restored(previous_handlers, signum):
    handlers, calls = previous_handlers
    with PreemptionSignals() as signals:
        assert signals.received == 0
        os.kill(os.getpid(), signum)
        assert signals.received == signum
        assert signals.received_on_any_rank(torch.device("cpu")) == signum  # one process: no collective
    assert calls == []  # the previous handler did not see it: ours replaced it
    assert {s: signal.getsignal(s) for s in PREEMPTION_SIGNALS} == handlers
    os.kill(os.getpid(), signum)
    assert calls == [signum]
    assert signal_name(signum) == signal.Signals(signum).name


def test_outside_the_main_thread_nothing_is_installed(previous_handlers):
    handlers, _ = previous_handlers
    outcome = {}

    def enter_in_a_thread():
        with pytest.warns(UserWarning, match="main thread"):
            with PreemptionSignals() as signals:
                outcome["handlers"] = {s: signal.getsignal(s) for s in PREEMPTION_SIGNALS}
                outcome["received"] = signals.received

    thread = threading.Thread(target=enter_in_a_thread)
    thread.start()
    thread.join()
    assert outcome == {"handlers": handlers, "received": 0}


def test_leaving_twice_does_not_put_back_stale_handlers():
    def mine(signum, frame):
        pass

    previous = signal.getsignal(signal.SIGUSR1)
    try:
        guard = PreemptionSignals()
        with guard:
            pass
        signal.signal(signal.SIGUSR1, mine)
        guard.__exit__(None, None, None)
        assert signal.getsignal(signal.SIGUSR1) is mine
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _signal_seen_by_the_ranks(rank, world):
    import torch

    guard = PreemptionSignals()
    guard.received = (signal.SIGTERM, signal.SIGUSR1)[rank]
    return guard.received_on_any_rank(torch.device("cpu"))


def test_when_ranks_received_different_signals_every_rank_names_the_highest():
    from optimus.parallel.local_ranks import run_on_local_ranks

    assert run_on_local_ranks(_signal_seen_by_the_ranks, 2, timeout=60.0) == [signal.SIGTERM] * 2
