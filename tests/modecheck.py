"""One check for every way of moving data: a mode's forward and backward against the reference, and its counters.

    from modecheck import check_mode

Every rank takes its shard of the full arrays (the plan's positions, so any
layout or grid), runs ``ring_attention`` and ``ring_attention_backward``, and
checks its own out, lse, dq, dk, dv against the dense float64 reference, its
bytes against ``nodes.predicted_bytes``, its messages and its recorded tasks
against the plan. Returns the forward and backward records.
"""

import numpy as np

from mpiring import Record, make_plan, ring_attention, ring_attention_backward
from mpiring.nodes import predicted_bytes
from mpiring.reference import dense_attention

from conftest import GRAD_TOL, dense_mask, naive_attention_backward


def problem(rng, S, hq, hk, dtype=np.float64, dim=8, dim_v=6):
    """Seeded full Q, K, V, dOut: batch 2, ``hq`` query and ``hk`` K/V heads, ``S`` tokens."""
    shapes = ((2, hq, S, dim), (2, hk, S, dim), (2, hk, S, dim_v), (2, hq, S, dim_v))
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def local(x, plan, rank, axis=-2):
    """This rank's shard of a full array under ``plan``."""
    return np.ascontiguousarray(np.take(x, plan.shards[rank], axis=axis))


def check_mode(comm, Q, K, V, dOut, options, note=""):
    """Forward and backward of ``options`` on ``comm`` against the reference; returns (forward, backward) Records.

    ``cu_seqlens="docs"``: packed documents [0, 2, 2, S - 4, S], one of them empty.
    """
    S, r = Q.shape[-2], comm.rank
    if isinstance(options.get("cu_seqlens"), str):
        options = dict(options, cu_seqlens=[0, 2, 2, S - 4, S])
    mask = dense_mask(S, options.get("causal", False), options.get("window"), options.get("cu_seqlens"))
    plan = make_plan(S, comm.size, **options)
    q, k, v, dout = (local(x, plan, r) for x in (Q, K, V, dOut))
    fwd, bwd = Record(), Record()
    out, lse = ring_attention(q, k, v, comm, record=fwd, **options)
    want_out, want_lse = dense_attention(Q, K, V, None, lambda a, b: mask[a:b])
    np.testing.assert_allclose(out, local(want_out, plan, r), atol=1e-12, rtol=0, err_msg=f"out {note}")
    np.testing.assert_allclose(lse, local(want_lse, plan, r, axis=-1), atol=1e-12, rtol=0, err_msg=f"lse {note}")
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, record=bwd, **options)
    for name, got, want in zip(("dq", "dk", "dv"), grads, naive_attention_backward(dOut, Q, K, V, mask)):
        np.testing.assert_allclose(got, local(want, plan, r), atol=GRAD_TOL[np.float64], rtol=0,
                                   err_msg=f"{name} {note}")
    plan = fwd.plan  # as the call resolved it (the double ring's nodes)
    shape = dict(batch=Q.shape[0], hq=Q.shape[-3], hk=K.shape[-3], dim=Q.shape[-1], dim_v=V.shape[-1],
                 itemsize=Q.dtype.itemsize)
    assert fwd.bytes_sent == predicted_bytes(plan, **shape)[r], note
    assert bwd.bytes_sent == predicted_bytes(plan, **shape, backward=True)[r], note
    assert bwd.messages == plan.backward_messages_per_rank(), note
    if plan.mode != "allgather":  # the plan counts point-to-point sends; the all-gather is one collective
        assert fwd.messages == plan.messages_per_rank(), note
    for rec in (fwd, bwd):
        assert rec.table(plan.n_steps) == [plan.tasks(s, r) for s in range(plan.n_steps)], note
        assert rec.visible_pairs == plan.visible_pairs()[r], note
    return fwd, bwd
