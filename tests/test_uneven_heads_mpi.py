"""Ulysses and the ring x Ulysses grid with any number of heads (``heads.deal_heads``), on P ranks.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_uneven_heads_mpi.py

Query heads not divisible by the ranks that share them out (4 over 3, 6 over 4, 12 over 8), K/V heads
that neither divide nor are divisible by them (3 over 2 or 4, 6 over 4), fewer K/V heads than ranks, GQA
groups split between ranks (``modecheck.head_cases``): every rank draws the whole problem from one seed,
keeps its shard (``shard_indices``) and checks out, lse, dq, dk, dv against the float64 reference, its
bytes against ``nodes.predicted_bytes``, its messages and tasks against the plan (``modecheck.check_mode``),
over every layout and mask (Ulysses' sweep of them: tests/test_ulysses_mpi.py). P is the world size; at
P = 1 everything is one rank's.
"""

import numpy as np
import pytest
from modecheck import check_mode, head_cases, local
from modecheck import problem as _problem

from mpiring import LAYOUTS, Record, ring_attention, ring_attention_backward, shard_indices
from mpiring.plans.heads import deal_heads
from mpiring.testing import assert_attention_close, reference, reference_backward

pytestmark = pytest.mark.mpi

MASKS = [(False, None, None), (True, None, None), (True, (4, 0), None), (False, (2, 2), "docs")]


def _grids(P):
    """Every group size u dividing P, with a ring mode across the groups (each mode in turn)."""
    modes = ("ring", "bidirectional", "allgather")
    return [(u, modes[i % 3]) for i, u in enumerate(u for u in range(1, P + 1) if P % u == 0)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window,cu", MASKS)
def test_grid_any_heads_match_reference(comm, rng, layout, causal, window, cu):
    """Every u dividing P; the heads of ``head_cases(u)`` (uneven over the group's u ranks)."""
    P = comm.size
    S = 4 * P + 5
    for u, mode in _grids(P):
        options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu, ulysses_size=u)
        for (hq, hk), why in head_cases(u).items():
            check_mode(comm, *_problem(rng, S, hq, hk), options, f"u={u} {mode} {hq}/{hk} ({why})")


@pytest.mark.parametrize("strategy", ["ulysses", "grid"])
def test_float64_results_are_exact(comm, rng, strategy):
    """out, lse within 1e-12 and the gradients within 1e-12 of max(1, |ref|) (``TOLERANCE``): causal zigzag,
    positions given, a sliding window; the GQA cases whose groups split between ranks."""
    P = comm.size
    S = 6 * P + 1
    options = dict(mode="ulysses") if strategy == "ulysses" else dict(ulysses_size=P, mode="ring")
    rows = shard_indices(S, P, comm.rank, "zigzag")
    for (hq, hk) in [c for c in head_cases(P) if c[0] != c[1]]:
        Q, K, V, dO = _problem(rng, S, hq, hk)
        q, k, v, do = (local(x, rows) for x in (Q, K, V, dO))
        run = dict(options, positions=rows, causal=True, window=(5, 0))
        out, lse = ring_attention(q, k, v, comm, **run)
        grads = ring_attention_backward(do, q, k, v, out, lse, comm, **run)
        want, want_lse = reference(Q, K, V, causal=True, window=(5, 0))
        assert_attention_close(out, local(want, rows), np.float64, "out")
        assert_attention_close(lse, local(want_lse, rows, axis=-1), np.float64, "lse")
        for name, got, ref in zip(("dq", "dk", "dv"), grads, reference_backward(dO, Q, K, V, causal=True,
                                                                                 window=(5, 0))):
            assert_attention_close(got, local(ref, rows), np.float64, name)


def test_a_rank_computes_its_own_heads(comm, rng, monkeypatch):
    """Each rank's kernel calls see the query heads the deal gives it and K/V heads in the ratio it holds:
    4 over 3 ranks at P = 3 is 2, 1, 1; a rank holding two heads of one group and one of the next (6/3 over
    2, ``held``) computes with its first K/V head repeated."""
    from mpiring.core import block

    P, r = comm.size, comm.rank
    seen = []

    def counted(q, k, v, *args, **kwargs):
        seen.append((q.shape[-3], k.shape[-3]))
        return kernel(q, k, v, *args, **kwargs)

    kernel = block.attention_block
    monkeypatch.setattr(block, "attention_block", counted)
    for hq, hk in [c for c in head_cases(P)]:
        seen.clear()
        Q, K, V, _ = _problem(rng, 4 * P, hq, hk)
        rows = shard_indices(4 * P, P, r)
        ring_attention(*(local(x, rows) for x in (Q, K, V)), comm, mode="ulysses")
        deal = deal_heads(hq, hk, P)
        assert set(seen) == {(deal.counts()[r], deal.held_counts()[r])}, (hq, hk)
    if P == 2:
        assert deal_heads(6, 3, 2).held_counts() == [3, 3]  # 3 query heads on 2 K/V heads: 1 of them held twice


def test_refused_head_counts_raise_on_every_rank(comm, rng):
    """Fewer query heads than ranks, and query heads not a multiple of the K/V heads (8 / 3), raise the same
    ValueError on every rank before anything moves; Ulysses works afterwards."""
    P = comm.size
    rows = shard_indices(4 * P, P, comm.rank)
    if P > 1:
        q, k, v, _ = (local(x, rows) for x in _problem(rng, 4 * P, P - 1 or 1, 1))
        for options in (dict(mode="ulysses"), dict(ulysses_size=P)):
            rec = Record()
            with pytest.raises(ValueError, match=f"needs at least one query head per part: {P - 1} query heads"):
                ring_attention(q, k, v, comm, record=rec, **options)
            assert rec.bytes_sent == 0 and rec.messages == 0
    q, k, v, _ = (local(x, rows) for x in _problem(rng, 4 * P, 8, 3))
    with pytest.raises(ValueError, match=r"q heads \(8\) must be a multiple of k/v heads \(3\)"):
        ring_attention(q, k, v, comm, mode="ulysses")
    q, k, v, _ = (local(x, rows) for x in _problem(rng, 4 * P, 9, 3))
    out, _ = ring_attention(q, k, v, comm, mode="ulysses", timeout=30)
    assert out.shape == q.shape[:-1] + (6,)
