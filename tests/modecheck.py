"""One check for every way of moving data: a mode's forward and backward against the reference, and its counters.

    from modecheck import check_mode

Every rank takes its shard of the full arrays from the public helper
(``shard_indices`` for a layout, the ``positions`` it passes otherwise; never
from the plan under test, so a plan that deals other tokens fails), runs
``ring_attention`` and ``ring_attention_backward``, and checks its own out,
lse, dq, dk, dv against the dense float64 reference, its bytes against
``nodes.predicted_bytes``, its messages and its recorded tasks against the
plan. Returns the forward and backward records.
"""

import numpy as np

from mpiring import Record, ring_attention, ring_attention_backward, shard_indices
from mpiring.core.reference import definition_mask, dense_attention
from mpiring.cost.nodes import predicted_bytes
from mpiring.plans.visibility import MaskPiece

from conftest import GRAD_TOL, naive_attention_backward


def problem(rng, S, hq, hk, dtype=np.float64, dim=8, dim_v=6):
    """Seeded full Q, K, V, dOut: batch 2, ``hq`` query and ``hk`` K/V heads, ``S`` tokens."""
    shapes = ((2, hq, S, dim), (2, hk, S, dim), (2, hk, S, dim_v), (2, hq, S, dim_v))
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def head_cases(P):
    """``(Hq, Hk)`` pairs that Ulysses (or a grid's group) deals over P ranks unevenly, each with why it is here:
    query heads not divisible by P, GQA groups split between ranks, fewer K/V heads than ranks, K/V heads
    neither dividing nor divisible by P (``heads.deal_heads``); those with Hq >= P."""
    u = P + P // 2  # not divisible by P from P = 2: 3 over 2, 4 over 3, 6 over 4, 12 over 8
    cases = {(u, u): "MHA, uneven", (2 * u, u): "GQA, groups split", (u, 1): "MQA, uneven",
             (8, 2): "8 query heads, 2 K/V", (9, 3): "3 K/V heads", (6, 3): "3 K/V heads, 2 each",
             (2 * P, 2 * P): "even, as before"}
    return {hk: why for hk, why in cases.items() if hk[0] >= P}


def local(x, rows, axis=-2):
    """This rank's shard of a full array: the rows at ``rows`` (global positions) on ``axis``."""
    return np.ascontiguousarray(np.take(x, rows, axis=axis))


def rows_of(comm, S, options, kv=False):
    """This rank's query (``kv``: key) positions as the caller knows them: its ``positions``, or the layout's."""
    given = options.get("kv_positions" if kv and options.get("kv_positions") is not None else "positions")
    if given is not None:
        return np.asarray(given)
    return shard_indices(S, comm.size, comm.rank, options.get("layout", "contiguous"))


def check_mode(comm, Q, K, V, dOut, options, note=""):
    """Forward and backward of ``options`` on ``comm`` against the reference; returns (forward, backward) Records.

    ``cu_seqlens="docs"``: packed documents [0, 2, 2, S - 4, S], one of them empty.
    """
    S, r = Q.shape[-2], comm.rank
    if isinstance(options.get("cu_seqlens"), str):
        options = dict(options, cu_seqlens=[0, 2, 2, S - 4, S])
    pos = np.arange(S)
    given = options.get("mask") or ()
    mask = definition_mask(pos, pos, causal=options.get("causal", False), window=options.get("window"),
                           cu_seqlens=options.get("cu_seqlens"), causal_block=options.get("causal_block"),
                           mask=(given,) if isinstance(given, MaskPiece) else tuple(given))
    rows, kv_rows = rows_of(comm, S, options), rows_of(comm, S, options, kv=True)
    q, dout = (local(x, rows) for x in (Q, dOut))
    k, v = (local(x, kv_rows) for x in (K, V))
    fwd, bwd = Record(), Record()
    out, lse = ring_attention(q, k, v, comm, record=fwd, **options)
    want_out, want_lse = dense_attention(Q, K, V, None, lambda a, b: mask[a:b])
    np.testing.assert_allclose(out, local(want_out, rows), atol=1e-12, rtol=0, err_msg=f"out {note}")
    np.testing.assert_allclose(lse, local(want_lse, rows, axis=-1), atol=1e-12, rtol=0, err_msg=f"lse {note}")
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, record=bwd, **options)
    # the gradients of the queries this rank holds (the rest of dOut is zero: keys nobody queries get no dK)
    held = np.zeros(S, bool)
    held[np.concatenate(comm.allgather(rows))] = True
    dOut = np.where(held[:, None], dOut, 0)
    for name, got, want, at in zip(("dq", "dk", "dv"), grads, naive_attention_backward(dOut, Q, K, V, mask),
                                   (rows, kv_rows, kv_rows)):
        np.testing.assert_allclose(got, local(want, at), atol=GRAD_TOL[np.float64], rtol=0, err_msg=f"{name} {note}")
    plan = fwd.plan  # as the call resolved it (the double ring's nodes)
    shape = dict(batch=Q.shape[0], hq=Q.shape[-3], hk=K.shape[-3], dim=Q.shape[-1], dim_v=V.shape[-1],
                 itemsize=Q.dtype.itemsize)
    assert fwd.bytes_sent == predicted_bytes(plan, **shape)[r], note
    assert bwd.bytes_sent == predicted_bytes(plan, **shape, backward=True)[r], note
    assert bwd.messages == plan.messages_of(r, backward=True), note
    if plan.mode != "allgather":  # the plan counts point-to-point sends; the all-gather is one collective
        assert fwd.messages == plan.messages_of(r), note
    for rec in (fwd, bwd):
        assert rec.table(plan.n_steps) == [plan.tasks(s, r) for s in range(plan.n_steps)], note
        assert rec.visible_pairs == plan.visible_pairs()[r], note
    return fwd, bwd
