"""Ulysses (heads all-to-all) against the single-process reference, forward and backward, on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_ulysses_mpi.py

Every rank builds the same seeded problem, keeps its shard, and checks its own
results, bytes and recorded schedule; P is the world size. Query heads are 2P,
K/V heads 2P (no grouping), 2 and 1: with P > 2 the K/V heads are fewer than
the ranks and are replicated; and the uneven deals of ``modecheck.head_cases``.
"""

import numpy as np
import pytest
from modecheck import check_mode, head_cases
from modecheck import problem as _problem

from mpiring import LAYOUTS, distributed_attention, make_plan, ring_attention, ring_attention_backward, shard
from mpiring.core.reference import dense_attention
from mpiring.cost.nodes import predicted_bytes

from conftest import GRAD_TOL, dense_mask, naive_attention_backward, tol

pytestmark = pytest.mark.mpi

MASKS = [(False, None, None), (True, None, None), (True, (4, 0), None), (False, (2, 2), "docs")]


def _local(x, comm, layout, axis=-2):
    return np.ascontiguousarray(shard(x, comm.size, comm.rank, layout, axis=axis))


def _kv_counts(P):
    return sorted({2 * P, 1} | ({2} if P % 2 == 0 else set()))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window,cu", MASKS)
def test_forward_and_backward_match_reference(comm, rng, layout, causal, window, cu):
    P = comm.size
    S = 5 * P + 3  # uneven on purpose
    options = dict(layout=layout, mode="ulysses", causal=causal, window=window, cu_seqlens=cu)
    cases = {(2 * P, hk): f"{hk} K/V heads" for hk in _kv_counts(P)}
    for (hq, hk), why in {**cases, **head_cases(P)}.items():  # and any number of heads (deal_heads)
        check_mode(comm, *_problem(rng, S, hq, hk), options, f"{hq}/{hk} ({why})")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dtypes_gqa_and_a_long_sequence(comm, rng, dtype):
    P = comm.size
    S = 48 * P
    Q, K, V, dOut = _problem(rng, S, 4 * P, 1, dtype, dim=16, dim_v=16)
    q, k, v, dout = (_local(x, comm, "zigzag") for x in (Q, K, V, dOut))
    options = dict(layout="zigzag", mode="ulysses", causal=True, scale=0.3)
    out, lse = ring_attention(q, k, v, comm, **options)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, **options)
    mask = dense_mask(S, causal=True)
    want = dense_attention(Q, K, V, 0.3, lambda a, b: mask[a:b])[0]
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    np.testing.assert_allclose(out, _local(want, comm, "zigzag"), atol=tol(dtype), rtol=0)
    for got, want in zip(grads, naive_attention_backward(dOut, Q, K, V, mask, 0.3)):
        np.testing.assert_allclose(got, _local(want, comm, "zigzag"), atol=GRAD_TOL[dtype], rtol=0)


def test_distributed_attention_gathers_ulysses(comm, rng):
    P = comm.size
    S = 7 * P
    Q, K, V, _ = _problem(rng, S, 2 * P, 1)
    out, schedule = distributed_attention(Q, K, V, comm, causal=True, layout="striped", mode="ulysses", timeout=30)
    if comm.rank != 0:
        return
    mask = dense_mask(S, causal=True)
    np.testing.assert_allclose(out, dense_attention(Q, K, V, None, lambda a, b: mask[a:b])[0], atol=1e-12, rtol=0)
    plan = make_plan(S, P, causal=True, layout="striped", mode="ulysses")
    assert schedule == plan.schedule
    assert [r["bytes_sent"] for r in schedule.records] == predicted_bytes(plan, batch=2, hq=2 * P, hk=1, dim=8,
                                                                          dim_v=6, itemsize=8)


def test_heads_that_do_not_split_raise_on_every_rank(comm, rng):
    """Fewer query heads than ranks, or no heads axis; any other count splits (tests/test_uneven_heads_mpi.py)."""
    P = comm.size
    if P == 1:
        pytest.skip("one rank takes any number of heads")
    q, k, v, dout = (_local(x, comm, "contiguous") for x in _problem(rng, 4 * P, P - 1, 1))
    with pytest.raises(ValueError, match=rf"ranks 0(, 1|-{P - 1}): mode='ulysses' needs at least one query head "
                                         rf"per part: {P - 1} query heads for the number of ranks \({P}\)"):
        ring_attention(q, k, v, comm, mode="ulysses")
    if P > 2:  # the ring takes them; the backward's check is Ulysses' own
        out, lse = ring_attention(q, k, v, comm)
        with pytest.raises(ValueError, match="needs at least one query head per part"):
            ring_attention_backward(dout, q, k, v, out, lse, comm, mode="ulysses")
    flat = [a[0, 0] for a in (q, k, v)]  # (seq, dim): no heads axis to split
    with pytest.raises(ValueError, match="splits the heads axis"):
        ring_attention(*flat, comm, mode="ulysses")
    q, k, v, _ = (_local(x, comm, "contiguous") for x in _problem(rng, 4 * P, 2 * P, 1))
    out, lse = ring_attention(q, k, v, comm, mode="ulysses", timeout=30)  # and it still works afterwards
    assert out.shape == q.shape[:-1] + (6,)


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_a_rank_calls_the_kernel_at_most_once_per_key_block(comm, rng, monkeypatch, layout):
    """Issue 34: with zigzag or striped shards Ulysses called the kernel once per query shard and key block,
    about 1.5 P^2 times a pass (100 at P = 8, causal zigzag); with the rows in position order it is once per
    key block, at most P times, forward and backward."""
    from mpiring.core import block

    P = comm.size
    calls = {"forward": 0, "backward": 0}

    def counted(name, kernel):
        def run(*args, **kwargs):
            calls[name] += 1
            return kernel(*args, **kwargs)
        return run

    monkeypatch.setattr(block, "attention_block", counted("forward", block.attention_block))
    monkeypatch.setattr(block, "attention_block_backward", counted("backward", block.attention_block_backward))
    S = 32 * P
    Q, K, V, dOut = _problem(rng, S, 2 * P, 2 * P)
    q, k, v, dout = (_local(x, comm, layout) for x in (Q, K, V, dOut))
    options = dict(layout=layout, mode="ulysses", causal=True, timeout=60)
    out, lse = ring_attention(q, k, v, comm, **options)
    ring_attention_backward(dout, q, k, v, out, lse, comm, **options)
    assert 1 <= calls["forward"] <= P and 1 <= calls["backward"] <= P, calls
    mask = dense_mask(S, causal=True)
    np.testing.assert_allclose(out, _local(dense_attention(Q, K, V, None, lambda a, b: mask[a:b])[0], comm, layout),
                               atol=1e-12, rtol=0)
