"""Two threads calling mpiring on one communicator at once: a clear error, not MPI garbage.

    python -m pytest -q tests/test_threads.py
"""

import threading
import time

import numpy as np
import pytest

from mpiring import ring_attention
from mpiring.core import block


def test_a_second_thread_on_the_same_communicator_is_refused(monkeypatch):
    from mpi4py import MPI

    comm = MPI.COMM_SELF
    q = k = v = np.random.default_rng(0).standard_normal((2, 16, 8))
    inside, release = threading.Event(), threading.Event()
    real = block.attend

    def slow_attend(*args, **kwargs):  # the first call holds the communicator until released
        inside.set()
        release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(block, "attend", slow_attend)
    first = threading.Thread(target=ring_attention, args=(q, k, v, comm))
    first.start()
    assert inside.wait(10)
    monkeypatch.setattr(block, "attend", real)
    with pytest.raises(RuntimeError, match="give each thread its own comm.Dup"):
        ring_attention(q, k, v, comm)
    dup = comm.Dup()  # its own duplicate: fine, even while the first call runs
    out, _ = ring_attention(q, k, v, dup)
    dup.Free()
    release.set()
    first.join(10)
    time.sleep(0)
    assert not first.is_alive()
    out2, _ = ring_attention(q, k, v, comm)  # released: the communicator is free again
    np.testing.assert_array_equal(out, out2)
