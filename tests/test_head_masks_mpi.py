"""Masks per batch entry and head, and cross-attention, under every strategy: against flex_attention (forward),
torch autograd (backward) and the float64 reference, on however many ranks the test runs; the sparse movement's
bytes against the cost model.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_head_masks_mpi.py

Shards come from ``mpiring.shard_indices``; the inputs are drawn whole from one seed on every rank, then sliced.
"""

import functools

import numpy as np
import pytest
from flex_cases import B, H, arrays, expected, numpy_fn, rules

import mpiring
from mpiring import masks, shard_indices
from mpiring.cost.nodes import predicted_bytes
from mpiring.testing import reference, reference_backward

pytestmark = pytest.mark.mpi

# one compact sweep: every strategy once per case, each with the layouts of queries and keys it meets
RUNS = [("ring", dict(layout="zigzag")), ("ring", dict(layout="contiguous", kv_layout="zigzag")),
        ("bidirectional", dict(layout="zigzag", kv_layout="contiguous")), ("allgather", dict(layout="contiguous")),
        ("pass-q", dict(rotate="q", layout="zigzag")), ("ulysses", dict(mode="ulysses", layout="zigzag")),
        ("double_ring", dict(mode="double_ring", layout="contiguous")), ("sparse", dict(mode="sparse",
                                                                                         layout="zigzag")),
        ("grid", dict(ulysses_size=2, layout="contiguous", kv_layout="zigzag"))]
LENGTHS = {"self": lambda P: (5 * P + 2, None), "cross, fewer keys": lambda P: (6 * P + 1, 3 * P + 2),
           "cross, more keys": lambda P: (3 * P + 1, 7 * P + 3)}


def _comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


@functools.lru_cache(maxsize=None)
def _problem(name, sq, sk):
    """The arrays, flex's and autograd's results, and the reference's, once per case on every rank."""
    rule, options = rules(sq, sk)[name]
    Q, K, V, dO = arrays(sq, sk)
    mask = masks.function(numpy_fn(rule), batch=B, heads=H)
    want = expected(rule, options.get("causal", False), Q, K, V, dO)
    ref = (*reference(Q, K, V, mask=mask, **options), *reference_backward(dO, Q, K, V, mask=mask, **options))
    return (Q, K, V, dO), mask, options, want, ref


def _applies(strategy, P):
    return not (strategy == "ulysses" and H % P or strategy == "grid" and P % 2)


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("name", list(rules(1, 1)))
def test_every_strategy_matches_flex_autograd_and_the_reference(name, lengths):
    pytest.importorskip("torch")
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    sq, sk = LENGTHS[lengths](P)
    (Q, K, V, dO), mask, options, want, ref = _problem(name, sq, sk or sq)
    for strategy, how in RUNS:
        if not _applies(strategy, P):
            continue
        how = dict(how)
        kv_layout = how.pop("kv_layout", how["layout"])
        kv_layout = kv_layout if sk else how["layout"]  # one sequence: the keys are the queries' rows
        cross = dict(kv_seq_len=sk, kv_layout=kv_layout) if sk else {}
        i, j = shard_indices(sq, P, r, how["layout"]), shard_indices(sk or sq, P, r, kv_layout)
        kw = dict(options, mask=mask, **how, **cross)
        q, k, v, do = Q[..., i, :], K[..., j, :], V[..., j, :], dO[..., i, :]
        out, lse = mpiring.ring_attention(q, k, v, comm, **kw)
        grads = mpiring.ring_attention_backward(do, q, k, v, out, lse, comm, **kw)
        where = f"{name}, {lengths}, {strategy} {how}, P={P}"
        rows = dict(out=np.s_[..., i, :], lse=np.s_[..., i], dq=np.s_[..., i, :], dk=np.s_[..., j, :],
                    dv=np.s_[..., j, :])
        for (label, axis), mine, flex, dense in zip(rows.items(), (out, lse, *grads), want, ref):
            np.testing.assert_allclose(mine, flex[axis], atol=1e-12, rtol=0, err_msg=f"{label} vs torch: {where}")
            np.testing.assert_allclose(mine, dense[axis], atol=1e-12, rtol=0, err_msg=f"{label} vs ref: {where}")


@pytest.mark.parametrize("lengths", ["self", "cross, fewer keys"])
def test_the_sparse_movement_sends_what_its_model_predicts(lengths):
    """A per-head mask moves the union over heads and batch entries: the bytes sent are the cost model's."""
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    sq, sk = LENGTHS[lengths](P)
    rule, options = rules(sq, sk or sq)["per-head tiles, causal"]
    Q, K, V, dO = arrays(sq, sk or sq, seed=3)
    i, j = shard_indices(sq, P, r, "zigzag"), shard_indices(sk or sq, P, r, "zigzag")
    kw = dict(options, mode="sparse", layout="zigzag", mask=masks.function(numpy_fn(rule), batch=B, heads=H),
              **(dict(kv_seq_len=sk) if sk else {}))
    fwd, bwd = mpiring.Record(r), mpiring.Record(r)
    out, lse = mpiring.ring_attention(Q[..., i, :], K[..., j, :], V[..., j, :], comm, record=fwd, **kw)
    mpiring.ring_attention_backward(dO[..., i, :], Q[..., i, :], K[..., j, :], V[..., j, :], out, lse, comm,
                                    record=bwd, **kw)
    shape = dict(batch=B, hq=H, hk=K.shape[1], dim=K.shape[-1], dim_v=V.shape[-1], itemsize=8)
    assert fwd.bytes_sent == predicted_bytes(fwd.plan, **shape)[r]
    assert bwd.bytes_sent == predicted_bytes(fwd.plan, **shape, backward=True)[r]


def test_a_mask_over_other_heads_raises_on_every_rank():
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    S = 4 * P
    Q, K, V, _ = arrays(S, S)
    i = shard_indices(S, P, r)
    bad = masks.function(lambda b, h, q, k: q >= k, batch=B, heads=H + 1)
    with pytest.raises(ValueError, match=f"q holds {B} batch entries .* and {H} heads"):
        mpiring.ring_attention(Q[..., i, :], K[..., i, :], V[..., i, :], comm, mask=bad)


def test_decoding_takes_a_mask_per_batch_entry_and_head():
    """New tokens over a cache striped over the ranks: each (batch entry, head) its own mask, as the reference."""
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    S, T = 5 * P + 2, 3
    Q, K, V, _ = arrays(T, S, seed=5)
    mask = masks.function(lambda b, h, qp, kp: (kp * (h + 1) % 5 != b) | (kp == 0), batch=B, heads=H)
    positions, rows = np.arange(S - T, S), shard_indices(S, P, r, "striped")
    out, lse = mpiring.decode_attention(Q, K[..., rows, :], V[..., rows, :], comm, causal=True, positions=positions,
                                        kv_positions=rows, mask=mask)
    want, want_lse = reference(Q, K, V, causal=True, mask=mask, q_positions=positions)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)


def test_the_torch_adapter_takes_cross_attention_and_a_mask_per_head():
    """mpiring.torch under autograd: queries over another sequence's keys, each head its own mask, as SDPA."""
    torch = pytest.importorskip("torch")
    import mpiring.torch

    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    sq, sk = 3 * P + 1, 2 * P + 3
    Q, K, V, dO = (torch.from_numpy(a) for a in arrays(sq, sk, seed=7))
    mask = masks.function(lambda b, h, qp, kp: (kp <= qp + h) | (kp == b), batch=B, heads=H)
    allowed = torch.from_numpy(np.array(mask.allows(np.arange(sq)[:, None], np.arange(sk)[None, :])))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=allowed, enable_gqa=True)
    (want * dO).sum().backward()
    i = torch.from_numpy(shard_indices(sq, P, r, "zigzag"))
    j = torch.from_numpy(shard_indices(sk, P, r, "contiguous"))
    q, k, v = (t[..., rows, :].clone().requires_grad_() for t, rows in ((Q, i), (K, j), (V, j)))
    out = mpiring.torch.ring_attention(q, k, v, comm=comm, mask=mask, layout="zigzag", kv_layout="contiguous",
                                       kv_seq_len=sk)
    (out * dO[..., i, :]).sum().backward()
    torch.testing.assert_close(out, want[..., i, :].detach(), atol=1e-12, rtol=0)
    for got, leaf, rows in zip((q.grad, k.grad, v.grad), leaves, (i, j, j)):
        torch.testing.assert_close(got, leaf.grad[..., rows, :], atol=1e-12, rtol=0)


def test_root_scatter_refuses_cross_attention_by_name():
    comm = _comm()
    Q = np.zeros((2, 4 * comm.Get_size(), 8)) if comm.Get_rank() == 0 else None
    with pytest.raises(ValueError, match="cross-attention \\(kv_seq_len\\) is ring_attention's"):
        mpiring.distributed_attention(Q, Q, Q, comm, kv_seq_len=4)
