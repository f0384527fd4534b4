"""Lab 0 (warm-up): a ring all-reduce, the algorithm inside MPI's Allreduce.

    mpiexec -n 4 python -m mpiring grade examples/exercises/00_allreduce.py

Every rank holds x (N elements); every rank must return the sum over all ranks. Cut x into P
chunks (np.array_split). Reduce-scatter: at step t = 0 .. P-2 rank r sends chunk (r - t) mod P to
rank r + 1 and adds what it receives from rank r - 1 into chunk (r - t - 1) mod P; rank r then
holds the complete sum of chunk (r + 1) mod P. All-gather: P - 1 more steps pass the complete
chunks on, without adding. Each rank sends 2 (P - 1) chunks of N/P elements, whatever P is.
Fill in the TODOs (docs/course.md).
"""

# ruff: noqa: F841  (a skeleton: incomplete until its TODOs are done)

import numpy as np

EXERCISE = "allreduce"


def ring_allreduce(x, comm):
    """The sum of every rank's x, on every rank, by the ring: reduce-scatter, then all-gather."""
    rank, P = comm.Get_rank(), comm.Get_size()
    out = np.array(x, copy=True)
    parts = np.array_split(out, P)  # views of out: chunk c is parts[c]
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    for t in range(P - 1):
        send, add = (rank - t) % P, (rank - t - 1) % P
        # TODO: send parts[send] to send_to while receiving rank recv_from's chunk into a new buffer
        #       (comm.Sendrecv), then add the buffer into parts[add]
        raise NotImplementedError("lab 0: the reduce-scatter")
    for t in range(P - 1):
        send, put = (rank + 1 - t) % P, (rank - t) % P
        # TODO: send the complete chunk parts[send] on, and receive the complete chunk parts[put]
        raise NotImplementedError("lab 0: the all-gather")
    return out
