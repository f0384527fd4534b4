"""A head-parallel attention over mpi4py written the way third-party code often is (a fixture for the kit's tests).

Every rank holds a sequence shard (H, n, D) of q, k, v; an all-to-all gives each rank H/P heads
of the whole sequence, it attends them, and an all-to-all brings the outputs back to the
sequence shards. Three all-to-alls: ``send_first`` (every rank sends all its pieces, then
receives: correct only while MPI buffers the sends, i.e. below its eager limit), ``safe``
(Irecv/Isend then ``MPI.Request.Waitall``) and ``wrong_source`` (receives from the wrong rank).
"""

import numpy as np
from mpi4py import MPI

TAG = 77


def send_first(pieces, comm):
    P, r = comm.Get_size(), comm.Get_rank()
    got = [None] * P
    got[r] = pieces[r]
    for d in range(P):
        if d != r:
            comm.Send(np.ascontiguousarray(pieces[d]), dest=d, tag=TAG)
    for s in range(P):
        if s != r:
            got[s] = np.empty_like(pieces[s])
            comm.Recv(got[s], source=s, tag=TAG)
    return got


def safe(pieces, comm, shift=0):
    P, r = comm.Get_size(), comm.Get_rank()
    got, requests = [None] * P, []
    got[r] = pieces[r]
    for s in range(P):
        if s != r:
            got[s] = np.empty_like(pieces[s])
            requests.append(comm.Irecv(got[s], source=(s + shift) % P, tag=TAG))
    for d in range(P):
        if d != r:
            requests.append(comm.Isend(np.ascontiguousarray(pieces[d]), dest=d, tag=TAG))
    MPI.Request.Waitall(requests)
    return got


def wrong_source(pieces, comm):
    return safe(pieces, comm, shift=1)


def head_parallel_attention(q, k, v, comm, alltoall=safe):
    """This rank's output rows (H, n, D) of non-causal attention; H a multiple of P."""
    P = comm.Get_size()
    H, n, D = q.shape
    h = H // P

    def to_heads(x):  # (H, n, D) sequence shard -> (h, n * P, D): this rank's heads, every token
        return np.concatenate(alltoall([x[d * h:(d + 1) * h] for d in range(P)], comm), axis=1)

    qh, kh, vh = (to_heads(x) for x in (q, k, v))
    s = qh @ np.swapaxes(kh, -1, -2) / np.sqrt(D)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    out = (p / p.sum(axis=-1, keepdims=True)) @ vh
    return np.concatenate(alltoall([out[:, s * n:(s + 1) * n] for s in range(P)], comm), axis=0)
