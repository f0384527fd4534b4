"""This machine as a ``Machine`` of the time model: the attention kernel's FLOP/s, the link's alpha and beta.

    python -m mpiring cost --seq-len 65536 -P 2 --hidden 512 --heads 8 --preset this-machine

``run`` calibrates on its own ranks, so its time model speaks of the machine it ran on.
"""

import time

import numpy as np
from threadpoolctl import threadpool_limits

from mpiring import attention_block
from mpiring.cost.costmodel import Machine, block_flops

__all__ = ["calibrate", "NO_MPI_ALPHA"]

NO_MPI_ALPHA = 1e-6  # seconds per message assumed when there is no communicator to time


def calibrate(comm=None, *, head_dim=64, dtype="float32", tokens=512, nbytes=32 << 20, seconds=0.4, threads=1):
    """Measure this machine: the attention kernel's FLOP/s and the link's alpha and beta (about ``seconds``).

    Compute: ``attention_block`` on one head of ``tokens`` x ``tokens`` with ``threads`` BLAS threads on every
    rank at once, without and with a causal mask. Link: every rank sends to the next around the ring at once,
    8 bytes (alpha), then ``nbytes`` (beta), the slowest rank counting; with one process a memory copy (beta)
    and a message to itself (alpha); without a communicator alpha is ``NO_MPI_ALPHA``.
    """
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, tokens, head_dim)).astype(dtype) for _ in range(3))
    klo, khi = np.zeros(tokens, np.int64), np.arange(1, tokens + 1)  # causal diagonal block

    def rate(*mask):
        return block_flops(tokens, tokens, 1, head_dim) * _per_second(lambda: attention_block(q, k, v, None, *mask),
                                                                      seconds / 4)

    with threadpool_limits(threads):
        flops, masked = rate(), rate(klo, khi)
    small, big = np.zeros(1, np.float64), np.zeros(max(nbytes // 8, 1), np.float64)
    if comm is not None and comm.Get_size() > 1:
        alpha, beta = _ring_link(comm, small, big)
        flops, masked = min(comm.allgather(flops)), min(comm.allgather(masked))
        where = f"{comm.Get_size()} ranks"
    else:
        copy = np.empty_like(big)
        beta = big.nbytes * _per_second(lambda: np.copyto(copy, big), seconds / 4)  # a memory copy
        alpha = _self_message(comm, small) if comm is not None else NO_MPI_ALPHA
        where = "one process: memory copy" + ("" if comm is not None else f", {NO_MPI_ALPHA * 1e6:g} us assumed")
    note = (f"measured: attention kernel {flops / 1e9:.2f} GFLOP/s, {masked / 1e9:.2f} masked ({dtype}, "
            f"{threads} thread, {tokens}x{tokens}x{head_dim}); link {beta / 1e9:.2f} GB/s, {alpha * 1e6:.1f} us "
            f"({where})")
    return Machine("this-machine", float(flops), float(alpha), float(beta), note, float(masked))


def _ring_link(comm, small, big):
    """(alpha, beta) of the ring: every rank sends to the next at once; the slowest rank counts."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dest, source = (rank + 1) % size, (rank - 1) % size

    def ring(buf, reps):
        recv = np.empty_like(buf)
        comm.Barrier()
        t = time.perf_counter()
        for _ in range(reps):
            comm.Sendrecv(buf, dest, 7, recv, source, 7)
        return max(comm.allgather((time.perf_counter() - t) / reps))

    ring(small, 5)
    alpha = ring(small, 50)
    return alpha, big.nbytes / max(ring(big, 4) - alpha, 1e-9)


def _per_second(fn, seconds):
    """Calls of ``fn`` per second, timed for about ``seconds`` (3 calls at least) after one to warm up."""
    fn()
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < seconds:
        fn()
        reps += 1
    return reps / (time.perf_counter() - start)


def _self_message(comm, small, reps=50):
    """Seconds of an 8-byte message from the one rank of ``comm`` to itself."""
    recv = np.empty_like(small)
    start = time.perf_counter()
    for _ in range(reps):
        req = comm.Irecv(recv, 0, 7)
        comm.Send(small, 0, 7)
        req.Wait()
    return (time.perf_counter() - start) / reps
