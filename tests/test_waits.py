"""How a rank waits (mpiring.mpi.waits.wait_until): after a short spin a wait sleeps between its polls, so a
rank waiting for a slower one leaves it the core; a wait for data also polls in bursts after each nap.

    python -m pytest -q tests/test_waits.py
"""

import threading
import time

import pytest
from mpi4py import MPI

from mpiring.mpi import waits


def _done_after(seconds, completed=None):
    """An MPI request (a generalized request) that completes ``seconds`` from now, from another thread (which
    appends the time it completed it to ``completed``)."""
    request = MPI.Grequest.Start()

    def complete():
        if completed is not None:
            completed.append(time.perf_counter())
        request.Complete()

    threading.Timer(seconds, complete).start()
    return request


@pytest.fixture(autouse=True)
def own_cores(monkeypatch):
    monkeypatch.setattr(waits, "shares_cores", lambda: False)  # as with one rank per core


def _cpu_of_wait(seconds, sync):
    wall, cpu = time.perf_counter(), time.process_time()
    waits.wait_until([_done_after(seconds)], 5.0, 0, "test wait", sync=sync)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert seconds - 0.05 < wall < seconds + 0.5
    return cpu


def test_a_long_wait_leaves_the_core():
    """1 s of waiting: a wait with no data spins 20 ms, then naps; a wait for data spins 0.1 s, then naps
    with a 1 ms burst of polls after each; neither holds the core for the whole wait, as MPI_Waitall would."""
    sync = _cpu_of_wait(1.0, True)
    data = _cpu_of_wait(1.0, False)
    assert sync < 0.1, sync
    assert waits.SPIN_SECONDS * 0.8 < data < 0.8, data


def test_a_sleeping_wait_still_answers_quickly():
    """Naps double from 50 us to at most 1 ms: completion is seen within about a millisecond of it (timed from
    the completion itself, not from the start: the timer thread's own wake-up is not the wait's)."""
    completed = []
    request = _done_after(0.3, completed)
    waits.wait_until([request], 5.0, 0, "test wait", sync=True)
    assert time.perf_counter() - completed[0] < 0.02


def test_timeout_still_raises():
    with pytest.raises(waits.CommTimeout, match="test wait not complete after 0.2 s"):
        waits.wait_until([_done_after(1.0)], 0.2, 0, "test wait", sync=True)
    time.sleep(1.0)  # the request completes before the next test
