"""Exercise 6, solution: the backward pass of ring attention.

    mpiexec -n 4 python -m mpiring grade --exercise backward examples/exercises/solutions/06_backward.py

Every rank keeps q, dout, out, lse; the K/V blocks travel the ring as in the forward pass, and
each carries its partial dK/dV with it: every rank adds its queries' contribution to the block
it holds, and after P - 1 hops one more hop takes the complete dK/dV home to its owner.
Probabilities are recomputed from the saved lse: P = exp(scale q k^T - lse).
"""

import numpy as np
from mpi4py import MPI

EXERCISE = "backward"


def block_backward(dout, q, k, v, lse, delta, scale, mask=None):
    """This block's share of dq, and its dk, dv, all in float64."""
    q, k, v, dout = (a.astype(np.float64) for a in (q, k, v, dout))
    s = q @ np.swapaxes(k, -1, -2) * scale
    p = np.exp(s - lse.astype(np.float64)[..., None])
    if mask is not None:
        p = np.where(mask, p, 0.0)
    dv = np.swapaxes(p, -1, -2) @ dout
    ds = p * (dout @ np.swapaxes(v, -1, -2) - delta[..., None])
    return ds @ k * scale, np.swapaxes(ds, -1, -2) @ q * scale, dv


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
    if P > 1:  # the block held now is rank + 1's, complete: one last hop home
        dk, dv = np.empty_like(dk_cur), np.empty_like(dv_cur)
        MPI.Request.Waitall([comm.Irecv(dk, source=recv_from, tag=2), comm.Irecv(dv, source=recv_from, tag=3),
                             comm.Isend(dk_cur, dest=send_to, tag=2), comm.Isend(dv_cur, dest=send_to, tag=3)])
    else:
        dk, dv = dk_cur, dv_cur
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)
