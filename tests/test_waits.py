"""How a rank waits (mpiring.comm.wait_until): a wait with no data sleeps between its polls after a
short spin, so a rank waiting for a slower one leaves it the core; a wait for data keeps polling.

    python -m pytest -q tests/test_waits.py
"""

import threading
import time

import pytest
from mpi4py import MPI

from mpiring import comm


def _done_after(seconds):
    """An MPI request (a generalized request) that completes ``seconds`` from now, from another thread."""
    request = MPI.Grequest.Start()
    threading.Timer(seconds, request.Complete).start()
    return request


@pytest.fixture(autouse=True)
def own_cores(monkeypatch):
    monkeypatch.setattr(comm, "shares_cores", lambda: False)  # as with one rank per core


@pytest.mark.parametrize("sync, most_cpu", [(True, 0.1), (False, None)])
def test_a_long_wait_leaves_the_core_unless_data_may_be_moving(sync, most_cpu):
    wall, cpu = time.perf_counter(), time.process_time()
    comm.wait_until([_done_after(0.5)], 5.0, 0, "test wait", sync=sync)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert 0.45 < wall < 1.0
    if most_cpu is not None:   # slept: a few percent of a core (the 20 ms spin and the polls)
        assert cpu < most_cpu, cpu
    else:                      # spun, as MPI_Waitall does: about the whole wait
        assert cpu > 0.4, cpu


def test_a_sleeping_wait_still_answers_quickly():
    """Naps double from 50 us to at most 1 ms: completion is seen within about a millisecond."""
    request = _done_after(0.3)
    start = time.perf_counter()
    comm.wait_until([request], 5.0, 0, "test wait", sync=True)
    assert time.perf_counter() - start < 0.3 + 0.02


def test_timeout_still_raises():
    with pytest.raises(comm.CommTimeout, match="test wait not complete after 0.2 s"):
        comm.wait_until([_done_after(1.0)], 0.2, 0, "test wait", sync=True)
    time.sleep(1.0)  # the request completes before the next test
