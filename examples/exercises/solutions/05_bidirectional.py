"""Exercise 5, solution: a bidirectional ring, K/V travel both ways.

    mpiexec -n 4 python -m mpiring grade --exercise bidirectional examples/exercises/solutions/05_bidirectional.py

Stream A passes blocks to rank + 1 (rank r receives r-1, r-2, ...), stream B to rank - 1
(r receives r+1, r+2, ...). A brings a = floor(P/2) blocks and B the other b = P - 1 - a, so
after floor(P/2) steps (not P - 1) every rank has seen every block: the same bytes, half the
latency-bound steps. Contiguous shards; causal as in exercise 3 (block s visible in full if
s < r, with the triangle if s == r).
"""

import numpy as np
from mpi4py import MPI

EXERCISE = "bidirectional"


def block_attention(q, k, v, scale, mask=None):
    """Softmax attention of q against one K/V block: (out, lse), in float64. mask: (nq, nk) bool or None."""
    s = (q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64)) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    total = p.sum(axis=-1, keepdims=True)
    safe = np.where(total > 0, total, 1.0)
    out = (p @ v.astype(np.float64)) / safe
    lse = np.where(total > 0, m + np.log(safe), -np.inf)[..., 0]
    return out, lse


def merge(out1, lse1, out2, lse2):
    """The log-sum-exp merge of two blocks' (out, lse) (exercise 1)."""
    m = np.maximum(lse1, lse2)
    m = np.where(np.isfinite(m), m, 0.0)
    w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
    total = w1 + w2
    safe = np.where(total > 0, total, 1.0)
    out = (w1[..., None] * out1 + w2[..., None] * out2) / safe[..., None]
    return out, np.where(total > 0, m + np.log(safe), -np.inf)


def _attend(q, k, v, source, rank, causal, scale, out, lse):
    if not causal or source < rank:
        return merge(out, lse, *block_attention(q, k, v, scale))
    if source == rank:
        n = q.shape[-2]
        return merge(out, lse, *block_attention(q, k, v, scale, np.tril(np.ones((n, n), bool))))
    return out, lse  # a block after every query of this rank: skip it


def ring_attention(q, k, v, comm, causal=False):
    """This rank's output (H, n, D); q, k, v are its contiguous shard."""
    rank, P = comm.Get_rank(), comm.Get_size()
    scale = 1.0 / np.sqrt(q.shape[-1])
    a = P // 2  # blocks stream A brings (from rank - 1); stream B brings the other P - 1 - a
    b = P - 1 - a
    out = np.zeros(q.shape[:-1] + v.shape[-1:])
    lse = np.full(q.shape[:-1], -np.inf)
    out, lse = _attend(q, k, v, rank, rank, causal, scale, out, lse)
    held = {"A": (np.ascontiguousarray(k), np.ascontiguousarray(v)), "B": (np.ascontiguousarray(k),
                                                                           np.ascontiguousarray(v))}
    streams = {"A": ((rank + 1) % P, (rank - 1) % P, a, 0), "B": ((rank - 1) % P, (rank + 1) % P, b, 2)}
    for step in range(1, a + 1):
        requests, incoming = [], {}
        for name, (send_to, recv_from, count, tag) in streams.items():
            if step <= count:
                kh, vh = held[name]
                incoming[name] = (np.empty_like(kh), np.empty_like(vh))
                requests += [comm.Irecv(incoming[name][0], source=recv_from, tag=tag),
                             comm.Irecv(incoming[name][1], source=recv_from, tag=tag + 1),
                             comm.Isend(kh, dest=send_to, tag=tag), comm.Isend(vh, dest=send_to, tag=tag + 1)]
        MPI.Request.Waitall(requests)
        for name, (kb, vb) in incoming.items():
            source = (rank - step) % P if name == "A" else (rank + step) % P
            out, lse = _attend(q, kb, vb, source, rank, causal, scale, out, lse)
            held[name] = (kb, vb)
    return out.astype(q.dtype)
