"""Exercise 6: the backward pass of ring attention.

    mpiexec -n 4 python -m mpiring grade --exercise backward examples/exercises/06_backward.py

K/V travel the ring as in the forward pass, each with its partial dK/dV. Fill in the TODOs
(docs/exercises.md).
"""

# ruff: noqa: F821  (a skeleton: incomplete until its TODOs are done)

import numpy as np
from mpi4py import MPI

EXERCISE = "backward"


def block_backward(dout, q, k, v, lse, delta, scale, mask=None):
    """This block's share of dq, and its dk, dv, all in float64."""
    q, k, v, dout = (a.astype(np.float64) for a in (q, k, v, dout))
    # TODO: p = exp(scale q k^T - lse) (zero where masked); dv = p^T dout;
    #       ds = p * (dout v^T - delta); dq = scale ds k; dk = scale ds^T q
    raise NotImplementedError("exercise 6: the gradients of one block")


def ring_attention_backward(dout, q, k, v, out, lse, comm, causal=False):
    """(dq, dk, dv) of this rank's contiguous shard, for the loss sum(dout * out)."""
    rank, P = comm.Get_rank(), comm.Get_size()
    n = q.shape[-2]
    scale = 1.0 / np.sqrt(q.shape[-1])
    send_to, recv_from = (rank + 1) % P, (rank - 1) % P
    delta = np.sum(dout.astype(np.float64) * out.astype(np.float64), axis=-1)  # rowsum(dout * out)
    dq = np.zeros(q.shape)
    k_cur, v_cur = np.ascontiguousarray(k), np.ascontiguousarray(v)
    dk_cur, dv_cur = np.zeros(k.shape), np.zeros(v.shape)  # the partial gradient of the block held
    for step in range(P):
        source = (rank - step) % P
        if not causal or source <= rank:
            mask = np.tril(np.ones((n, n), bool)) if causal and source == rank else None
            dq_part, dk_part, dv_part = block_backward(dout, q, k_cur, v_cur, lse, delta, scale, mask)
            dq += dq_part
            dk_cur += dk_part
            dv_cur += dv_part
        if step < P - 1:  # the block moves on with its partial gradients
            nxt = [np.empty_like(a) for a in (k_cur, v_cur, dk_cur, dv_cur)]
            requests = [comm.Irecv(buf, source=recv_from, tag=t) for t, buf in enumerate(nxt)]
            requests += [comm.Isend(a, dest=send_to, tag=t) for t, a in enumerate((k_cur, v_cur, dk_cur, dv_cur))]
            MPI.Request.Waitall(requests)
            k_cur, v_cur, dk_cur, dv_cur = nxt
    # TODO: the block held now belongs to rank + 1 and its dk_cur, dv_cur are complete: send them one more
    #       hop home, and receive this rank's own dk, dv from rank - 1 (with P = 1 they are already home)
    raise NotImplementedError("exercise 6: bring dK/dV home")
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
