"""The sparse movement (each K/V block straight to the ranks that need it) against the reference, on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_sparse_mpi.py

Every layout, every mask kind and some of their intersections, from one token
per rank up to uneven shards; every rank checks its own out, lse, dq, dk, dv
against the dense float64 reference, its bytes against the cost model, its
messages and recorded tasks against the plan (``modecheck.check_mode``), and
its sends against the graph of needed blocks.
"""

import numpy as np
import pytest
from modecheck import check_mode
from modecheck import problem as _problem

from mpiring import LAYOUTS, Record, ring_attention, ring_attention_backward, shard_indices
from mpiring.core.reference import definition_mask, dense_attention
from mpiring.cost.nodes import predicted_bytes
from mpiring.testing import tolerance

pytestmark = pytest.mark.mpi

MASKS = {"full": {}, "causal": dict(causal=True), "window": dict(causal=True, window=(3, 0)),
         "two-sided window": dict(window=(2, 2)), "documents": dict(cu_seqlens="docs"),
         "frames": dict(causal=True, causal_block=3), "window + documents": dict(window=(2, 1), cu_seqlens="docs")}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS)
def test_forward_and_backward_match_reference(comm, rng, layout, mask):
    P = comm.size
    for S in sorted({P, 2 * P + 1, 5 * P + 3}):  # one token per rank, uneven shards, longer ones
        if MASKS[mask].get("cu_seqlens") and S < 6:
            continue  # the documents [0, 2, 2, S - 4, S] need S >= 6
        arrays = _problem(rng, S, 4, 2)
        options = dict(layout=layout, mode="sparse", **MASKS[mask])
        fwd, bwd = check_mode(comm, *arrays, options, f"{mask} S={S}")
        plan, r = fwd.plan, comm.rank
        for rec, backward in ((fwd, False), (bwd, True)):
            sends = [(e[3]["step"], e[3]["dest"]) for e in rec.events if e[0] == "send"]
            assert sends == [(step, dest) for step, dest, _, _ in plan.sends(r, backward)], (mask, S)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
def test_torch_sdpa_and_autograd_agree(comm, dtype_name):
    """torch's own SDPA with an explicit boolean mask, and its autograd, beside the sparse movement."""
    torch = pytest.importorskip("torch")
    import mpiring.torch

    P, S, layout = comm.size, 7 * comm.size + 2, "zigzag"
    dtype = getattr(torch, dtype_name)
    options = dict(mode="sparse", layout=layout, window=(4, 1), cu_seqlens=[0, 3, S // 2, S])
    gen = torch.Generator().manual_seed(7)
    Q = torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64)
    K, V = (torch.randn(2, 2, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    W = torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64)  # loss = sum(W * out)
    pos = np.arange(S)
    mask = torch.from_numpy(definition_mask(pos, pos, window=(4, 1), cu_seqlens=options["cu_seqlens"]))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask, enable_gqa=True)
    (W * want).sum().backward()
    mine = shard_indices(S, P, comm.rank, layout)
    q, k, v = (t[..., mine, :].to(dtype).contiguous().requires_grad_() for t in (Q, K, V))
    out = mpiring.torch.ring_attention(q, k, v, comm=comm, **options)
    (W[..., mine, :].to(dtype) * out).sum().backward()
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), want[..., mine, :].detach(), atol=tol, rtol=0)
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(got.double(), leaf.grad[..., mine, :], atol=10 * tol, rtol=0)


@pytest.mark.parametrize("wire", [None, "bfloat16", "int8"])
def test_float32_and_coded_wires_send_the_predicted_bytes(comm, rng, wire):
    P = comm.size
    S = 6 * P + 1
    Q, K, V, dOut = _problem(rng, S, 4, 2, np.float32, dim=16, dim_v=16)
    rows = shard_indices(S, P, comm.rank, "striped")
    q, k, v, dout = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V, dOut))
    options = dict(mode="sparse", layout="striped", causal=True, window=(P + 1, 0), wire_dtype=wire)
    fwd, bwd = Record(), Record()
    out, lse = ring_attention(q, k, v, comm, record=fwd, **options)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, record=bwd, **options)
    pos = np.arange(S)
    allowed = definition_mask(pos, pos, causal=True, window=(P + 1, 0))
    want = dense_attention(*(x.astype(np.float64) for x in (Q, K, V)), None, lambda a, b: allowed[a:b])[0]
    np.testing.assert_allclose(out, want[..., rows, :], atol=tolerance(np.float32, wire), rtol=0)
    assert all(np.isfinite(g).all() for g in grads)
    shape = dict(batch=2, hq=4, hk=2, dim=16, dim_v=16, itemsize=4, wire_dtype=wire)
    assert fwd.bytes_sent == predicted_bytes(fwd.plan, **shape)[comm.rank]
    assert bwd.bytes_sent == predicted_bytes(fwd.plan, **shape, backward=True)[comm.rank]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_forward_is_the_rings_bit_for_bit(comm, rng, layout):
    """The same blocks merged in the same order (ring order, skips left out): the ring's out and lse exactly."""
    S = 5 * comm.size + 2
    Q, K, V, _ = _problem(rng, S, 4, 2)
    rows = shard_indices(S, comm.size, comm.rank, layout)
    q, k, v = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V))
    for mask in ({}, dict(causal=True, window=(3, 0)), dict(cu_seqlens=[0, 2, S // 2, S])):
        ring, sparse = (ring_attention(q, k, v, comm, layout=layout, mode=m, **mask) for m in ("ring", "sparse"))
        assert all(np.array_equal(a, b) for a, b in zip(ring, sparse)), mask


def test_a_rank_asking_another_movement_raises_on_every_rank(comm, rng):
    """Rank 0 asks for the sparse movement, the others for the ring: the same ValueError everywhere, nothing sent."""
    if comm.size == 1:
        pytest.skip("needs two ranks")
    S = 3 * comm.size
    Q, K, V, _ = _problem(rng, S, 2, 2)
    rows = shard_indices(S, comm.size, comm.rank, "contiguous")
    q, k, v = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V))
    rec = Record()
    with pytest.raises(ValueError, match="mode 'ring' differs from rank 0's 'sparse'"):
        ring_attention(q, k, v, comm, record=rec, causal=True, mode="sparse" if comm.rank == 0 else "ring")
    assert rec.bytes_sent == 0 and rec.messages == 0
