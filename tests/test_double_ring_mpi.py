"""The double ring (inner ring per node, outer ring across) against the reference, forward and backward, on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_double_ring_mpi.py

Every node size that divides P, and None (nodes as MPI places the ranks: one
here); every rank checks its own results, bytes, messages and recorded schedule.
"""

import numpy as np
import pytest
from modecheck import check_mode
from modecheck import problem as _problem

from mpiring import LAYOUTS, Record, ring_attention, ring_attention_backward, shard
from mpiring.core.reference import dense_attention
from mpiring.plans.hierarchy import INNER, OUTER

from conftest import GRAD_TOL, dense_mask, naive_attention_backward, tol

pytestmark = pytest.mark.mpi

MASKS = [(False, None, None), (True, None, None), (True, (4, 0), None), (False, (2, 2), "docs")]


def _local(x, comm, layout, axis=-2):
    return np.ascontiguousarray(shard(x, comm.size, comm.rank, layout, axis=axis))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window,cu", MASKS)
def test_forward_and_backward_match_reference(comm, rng, layout, causal, window, cu):
    P = comm.size
    S = 5 * P + 3
    arrays = _problem(rng, S, 4, 1)  # 4 query heads, 1 K/V head
    for node_size in [n for n in range(1, P + 1) if P % n == 0] + [None]:
        options = dict(layout=layout, mode="double_ring", causal=causal, window=window, cu_seqlens=cu,
                       node_size=node_size)
        fwd, _ = check_mode(comm, *arrays, options, f"node_size {node_size}")
        plan = fwd.plan
        assert plan.node_size == (node_size or P)  # one machine: MPI puts every rank on one node
        sends = [(e[3]["step"], e[3]["dest"], e[3]["link"]) for e in fwd.events if e[0] == "send"]
        assert sends == [(step, dest, link) for step, dest, _, _, link in plan.sends(comm.rank)]


def test_float32_and_links_named(comm, rng):
    P = comm.size
    S = 32 * P
    Q, K, V, dOut = _problem(rng, S, 2, 2, np.float32, dim=16, dim_v=16)
    q, k, v, dout = (_local(x, comm, "zigzag") for x in (Q, K, V, dOut))
    node_size = 2 if P % 2 == 0 else 1
    options = dict(layout="zigzag", mode="double_ring", causal=True, node_size=node_size)
    rec = Record()
    out, lse = ring_attention(q, k, v, comm, **options)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, record=rec, **options)
    mask = dense_mask(S, causal=True)
    np.testing.assert_allclose(out, _local(dense_attention(Q, K, V, None, lambda a, b: mask[a:b])[0], comm, "zigzag"),
                               atol=tol(np.float32), rtol=0)
    for got, want in zip(grads, naive_attention_backward(dOut, Q, K, V, mask)):
        np.testing.assert_allclose(got, _local(want, comm, "zigzag"), atol=GRAD_TOL[np.float32], rtol=0)
    links = {e[3]["link"] for e in rec.events if e[0] == "send"}
    want = {INNER} if node_size > 1 else set()  # the inner ring's, and the outer ring's where there are nodes
    assert links == (want | ({OUTER} if P > node_size else set()))


def test_bad_node_size_raises_on_every_rank(comm, rng):
    P = comm.size
    q, k, v, _ = (_local(x, comm, "contiguous") for x in _problem(rng, 4 * P, 4, 1))
    if P > 1:
        with pytest.raises(ValueError, match=f"node_size {P + 1} does not divide the {P} ranks"):
            ring_attention(q, k, v, comm, mode="double_ring", node_size=P + 1)
        mine = 1 if comm.rank == P - 1 else P  # the last rank disagrees
        with pytest.raises(ValueError, match=f"rank {P - 1}: node_size 1 differs from rank 0's {P}"):
            ring_attention(q, k, v, comm, mode="double_ring", node_size=mine)
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        ring_attention(q, k, v, comm, mode="double_ring", node_size=0)
    out, _ = ring_attention(q, k, v, comm, mode="double_ring", timeout=30)  # and it still works afterwards
    assert out.shape == q.shape[:-1] + (6,)
