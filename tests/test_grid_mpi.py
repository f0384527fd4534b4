"""Ring x Ulysses (``ulysses_size=u``) against the reference, forward and backward, on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_grid_mpi.py

Every u dividing P, with each ring mode; every rank holds the tokens ``shard_indices``
gives it under the layout, as in every other mode (a group's tokens are its members').
"""

import numpy as np
import pytest
from modecheck import check_mode, local
from modecheck import problem as _problem

from mpiring import LAYOUTS, ring_attention, ring_attention_backward, shard_indices
from mpiring.core.reference import dense_attention

from conftest import GRAD_TOL, dense_mask, naive_attention_backward, tol

pytestmark = pytest.mark.mpi

MASKS = [(False, None, None), (True, None, None), (True, (4, 0), "docs")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window,cu", MASKS)
def test_forward_and_backward_match_reference(comm, rng, layout, causal, window, cu):
    P = comm.size
    S = 6 * P + 5
    cases = (("ring", 1), ("bidirectional", 2), ("allgather", None))  # K/V heads: 1, 2 (< u at u = 4), 2u
    for i, u in enumerate(u for u in range(1, P + 1) if P % u == 0):
        mode, hk = cases[(i + LAYOUTS.index(layout)) % 3]  # every u meets every mode over the layouts
        hk = 2 * u if hk is None or (hk % u and u % hk) else hk
        options = dict(layout=layout, mode=mode, causal=causal, window=window, cu_seqlens=cu, ulysses_size=u)
        check_mode(comm, *_problem(rng, S, 2 * u, hk), options, f"u={u} {mode}")


def test_float32(comm, rng):
    P = comm.size
    u = 2 if P % 2 == 0 else 1
    S = 24 * P
    options = dict(layout="zigzag", causal=True, ulysses_size=u)
    rows = shard_indices(S, P, comm.rank, "zigzag")
    Q, K, V, dOut = _problem(rng, S, 4, 2, np.float32, dim=16, dim_v=16)
    q, k, v, dout = (local(x, rows) for x in (Q, K, V, dOut))
    out, lse = ring_attention(q, k, v, comm, **options)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, **options)
    mask = dense_mask(S, causal=True)
    want = dense_attention(Q, K, V, None, lambda a, b: mask[a:b])[0]
    np.testing.assert_allclose(out, local(want, rows), atol=tol(np.float32), rtol=0)
    for got, want in zip(grads, naive_attention_backward(dOut, Q, K, V, mask)):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, local(want, rows), atol=GRAD_TOL[np.float32], rtol=0)


def test_bad_grids_raise_on_every_rank(comm, rng):
    P = comm.size
    rows = shard_indices(8 * P, P, comm.rank)
    q, k, v, _ = (local(x, rows) for x in _problem(rng, 8 * P, 3, 1))
    if P > 1:
        with pytest.raises(ValueError, match=f"ulysses_size {P + 1} does not divide the {P} ranks"):
            ring_attention(q, k, v, comm, ulysses_size=P + 1)
    if P == 4:  # 3 query heads: any count from u up splits (tests/test_uneven_heads_mpi.py), fewer do not
        with pytest.raises(ValueError, match="ulysses_size 4 needs at least one query head per part: 3 query "
                                             "heads for ulysses_size \\(4\\)"):
            ring_attention(q, k, v, comm, ulysses_size=4)
    with pytest.raises(ValueError, match="ulysses_size combines with mode ring, bidirectional or allgather"):
        ring_attention(q, k, v, comm, mode="double_ring", ulysses_size=1)
    with pytest.raises(ValueError, match="ulysses_size must be a positive integer"):
        ring_attention(q, k, v, comm, ulysses_size=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_entry_point_deals_the_layouts_tokens(comm, rng, layout):
    """The handle's positions and shard, and distributed_*'s scatter, give each rank shard_indices' tokens
    under the grid (and the double ring), and the results are the reference's."""
    from mpiring import Ring, distributed_attention, distributed_attention_backward

    P, r = comm.size, comm.rank
    S = 5 * P + 3
    u = 2 if P % 2 == 0 else 1
    Q, K, V, dOut = _problem(rng, S, 4, 2)
    rows = shard_indices(S, P, r, layout)
    with Ring(comm, S, causal=True, layout=layout, ulysses_size=u) as ring:
        np.testing.assert_array_equal(ring.positions, rows)
        np.testing.assert_array_equal(ring.shard(Q), local(Q, rows))
    mask = dense_mask(S, causal=True)
    want = dense_attention(Q, K, V, None, lambda a, b: mask[a:b])[0]
    grads = naive_attention_backward(dOut, Q, K, V, mask)
    for options in (dict(ulysses_size=u), dict(mode="double_ring", node_size=1), dict(causal_block=1)):
        out, _ = distributed_attention(Q, K, V, comm, causal=True, layout=layout, **options)
        dq, dk, dv, _ = distributed_attention_backward(Q, K, V, dOut, comm, causal=True, layout=layout, **options)
        if r == 0:
            np.testing.assert_allclose(out, want, atol=1e-12, rtol=0, err_msg=str(options))
            for got, ref in zip((dq, dk, dv), grads):
                np.testing.assert_allclose(got, ref, atol=1e-10, rtol=0, err_msg=str(options))
