"""The backward block kernel and the analytic reference (one process), and the backward plan counts.

    python -m pytest -q tests/test_backward.py
"""

import subprocess
import sys
import warnings

import numpy as np
import pytest

from mpiring import make_plan, predicted_backward_bytes, predicted_bytes_sent
from mpiring.core import tiles
from mpiring.core.backends import attention_block, attention_block_backward
from mpiring.core.reference import reference_attention_backward
from mpiring.core.tiles import BlockRun
from mpiring.plans import plan as plans
from mpiring.plans.visibility import visible_keys

from conftest import GRAD_TOL, SHAPES, dense_mask, naive_attention, qkv
from launch import MPIEXEC, clean_env, mpiexec_argv

each_kernel = pytest.mark.usefixtures("each_kernel")  # a kernel test: once per GEMM and kernel backend


def _masks(seq_len, causal=False, window=None, cu=None):
    pos = np.arange(seq_len)
    return visible_keys(pos, pos, causal=causal, window=window or (-1, -1),
                        cu_seqlens=None if cu is None else np.array(cu))


def _numerical_grads(f, arrays, eps=1e-6):
    """Central differences of the scalar f(*arrays) with respect to every entry of every array."""
    grads = []
    for i, x in enumerate(arrays):
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            plus, minus = [a.copy() for a in arrays], [a.copy() for a in arrays]
            plus[i][idx] += eps
            minus[i][idx] -= eps
            g[idx] = (f(*plus) - f(*minus)) / (2 * eps)
        grads.append(g)
    return grads


@each_kernel
@pytest.mark.parametrize("causal,window,cu", [
    (False, None, None), (True, None, None), (True, (2, -1), None), (False, (1, 2), [0, 3, 3, 7]),
])
def test_kernel_matches_finite_differences(rng, causal, window, cu):
    q, k, v = qkv(rng, (2, 4, 7, 3), (2, 2, 7, 3))  # grouped-query, g = 2
    v = rng.standard_normal((2, 2, 7, 5))  # a different value dim
    dout = rng.standard_normal((2, 4, 7, 5))
    klo, khi = _masks(7, causal, window, cu)
    out, lse = attention_block(q, k, v, None, klo, khi)
    loss = lambda q, k, v: float(np.sum(attention_block(q, k, v, None, klo, khi)[0] * dout))  # noqa: E731
    numerical = _numerical_grads(loss, [q, k, v])
    for name, got, want in zip("qkv", attention_block_backward(dout, q, k, v, out, lse, None, klo, khi), numerical):
        np.testing.assert_allclose(got, want, atol=1e-7, rtol=0, err_msg=f"d{name}")
    for name, got, want in zip("qkv", reference_attention_backward(dout, q, k, v, None, klo, khi), numerical):
        np.testing.assert_allclose(got, want, atol=1e-7, rtol=0, err_msg=f"reference d{name}")


@each_kernel
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape_q,shape_kv", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_matches_reference(rng, dtype, shape_q, shape_kv, causal):
    q, k, v = qkv(rng, shape_q, shape_kv, dtype)
    dout = rng.standard_normal(shape_q).astype(dtype)
    klo, khi = _masks(shape_q[-2], causal) if causal else (None, None)
    out, lse = attention_block(q, k, v, None, klo, khi)
    grads = attention_block_backward(dout, q, k, v, out, lse, None, klo, khi)
    for got, want, like in zip(grads, reference_attention_backward(dout, q, k, v, None, klo, khi), (q, k, v)):
        assert got.dtype == dtype and got.shape == like.shape
        np.testing.assert_allclose(got, want, atol=GRAD_TOL[dtype], rtol=0)


def test_reference_is_the_gradient_of_naive_attention(rng):
    """The reference against finite differences of conftest's textbook formula, masks from dense_mask."""
    q, k, v = qkv(rng, (1, 2, 6, 3), (1, 1, 6, 3))
    dout = rng.standard_normal((1, 2, 6, 3))
    mask = dense_mask(6, causal=True, window=(3, 0), cu_seqlens=[0, 2, 6])
    loss = lambda q, k, v: float(np.sum(naive_attention(q, k, v, mask) * dout))  # noqa: E731
    klo, khi = _masks(6, True, (3, 0), [0, 2, 6])
    numerical = _numerical_grads(loss, [q, k, v])
    for got, want in zip(reference_attention_backward(dout, q, k, v, None, klo, khi), numerical):
        np.testing.assert_allclose(got, want, atol=1e-7, rtol=0)


@each_kernel
def test_key_blocks_add_up_to_the_whole(rng):
    """With the lse of all keys, per-block gradients sum (dq) or tile (dk, dv) to the full ones."""
    q, k, v = qkv(rng, (2, 4, 20, 8), (2, 2, 40, 8))
    dout = rng.standard_normal((2, 4, 20, 8))
    out, lse = attention_block(q, k, v, scale=0.3)
    dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, scale=0.3)
    cuts = [0, 7, 8, 25, 40]
    parts = [attention_block_backward(dout, q, k[..., a:b, :], v[..., a:b, :], out, lse, scale=0.3)
             for a, b in zip(cuts[:-1], cuts[1:])]
    np.testing.assert_allclose(sum(p[0] for p in parts), dq, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([p[1] for p in parts], axis=-2), dk, atol=1e-12)
    np.testing.assert_allclose(np.concatenate([p[2] for p in parts], axis=-2), dv, atol=1e-12)


@each_kernel
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_rows_that_see_nothing_contribute_zero(rng, dtype, monkeypatch):
    monkeypatch.setattr(tiles, "PROGRESS_INTERVAL", 0.0)  # progress is rate-limited: call it every tile here
    q, k, v = qkv(rng, (6, 4), dtype=dtype)
    dout = rng.standard_normal((6, 4)).astype(dtype)
    klo = np.array([0, 3, 2, 6, 0, 5])
    khi = np.array([6, 3, 4, 6, 0, 6])  # rows 1, 3 and 4 see nothing: out 0, lse -inf
    calls = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention_block(q, k, v, None, klo, khi)
        dq, dk, dv = attention_block_backward(dout, q, k, v, out, lse, None, klo, khi,
                                              run=BlockRun(progress=lambda: calls.append(1)))
    assert calls and all(np.all(np.isfinite(g)) for g in (dq, dk, dv))
    assert np.all(dq[[1, 3, 4]] == 0)
    for got, want in zip((dq, dk, dv), reference_attention_backward(dout, q, k, v, None, klo, khi)):
        np.testing.assert_allclose(got, want, atol=GRAD_TOL[dtype], rtol=0)


@each_kernel
def test_delta_may_be_given(rng):
    q, k, v = qkv(rng, (3, 9, 4))
    dout = rng.standard_normal((3, 9, 4))
    out, lse = attention_block(q, k, v)
    given = attention_block_backward(dout, q, k, v, out, lse, delta=np.sum(dout * out, axis=-1))
    for a, b in zip(given, attention_block_backward(dout, q, k, v, out, lse)):
        np.testing.assert_allclose(a, b, atol=1e-14, rtol=0)  # the kernel sums delta in its own order


@each_kernel
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_gradients_into_given_buffers(rng, dtype, causal):
    """``buffers=``: the gradients overwrite the given arrays (dirty ones too), and equal the kernel's own."""
    q = rng.standard_normal((2, 4, 37, 8)).astype(dtype)
    k, v = (rng.standard_normal((2, 2, 37, 8)).astype(dtype) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(dtype)
    lo, hi = (np.zeros(37, int), np.arange(1, 38)) if causal else (None, None)
    out, lse = attention_block(q, k, v, None, lo, hi)
    want = attention_block_backward(dout, q, k, v, out, lse, None, lo, hi, run=BlockRun(tile_q=16, tile_k=8))
    buffers = tuple(np.full(a.shape, np.nan, dtype) for a in (q, k, v))
    got = attention_block_backward(dout, q, k, v, out, lse, None, lo, hi, run=BlockRun(tile_q=16, tile_k=8),
                                   buffers=buffers)
    for a, b, buf in zip(got, want, buffers):
        assert np.shares_memory(a, buf)
        np.testing.assert_array_equal(a, b)
    wrong = tuple(np.empty(a.shape, np.float16) for a in (q, k, v))
    with pytest.raises(ValueError, match="compute dtype"):
        attention_block_backward(dout, q, k, v, out, lse, buffers=wrong)


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("mode", ["ring", "bidirectional", "allgather"])
@pytest.mark.parametrize("window,cu", [(None, None), ((5, 0), None), (None, [0, 10, 40])])
def test_backward_message_and_byte_counts(P, layout, mode, window, cu):
    plan = make_plan(40, P, layout=layout, mode=mode, causal=True, window=window, cu_seqlens=cu)
    n = plan.backward_messages_per_rank()
    if mode == "allgather":
        assert n == 4 * (P - 1)
    else:  # every K/V hop has its dK/dV hop, and the hop home is cut into key chunks: 2 more messages per chunk
        chunks = min(plans.HOME_CHUNKS, min(len(s) for s in plan.shards))
        assert plans.home_chunks(plan) == chunks
        homes = sum(rounds > 0 for rounds in plan.rounds.values())
        assert n == 2 * plan.messages_per_rank() + homes * 2 * (chunks - 1)
        kv, grads = predicted_bytes_sent(plan, 10, 4), predicted_backward_bytes(plan, 10, 4, grad_itemsize=0)
        assert grads == kv  # with free gradients, the backward pass moves exactly the forward K/V bytes
        if 40 % P == 0:  # even split: every dK/dV partial is one block, in float32 by default, or float64
            assert predicted_backward_bytes(plan, 10, 4) == [2 * b for b in kv]
            assert predicted_backward_bytes(plan, 10, 4, grad_itemsize=8) == [3 * b for b in kv]
            assert predicted_backward_bytes(plan, 10, 8) == [2 * b for b in predicted_bytes_sent(plan, 10, 8)]


def test_one_home_chunk_is_the_plain_hop_home(monkeypatch):
    """With HOME_CHUNKS = 1 every dK/dV hop is one message per array again: twice the forward count."""
    monkeypatch.setattr(plans, "HOME_CHUNKS", 1)
    for mode in ("ring", "bidirectional"):
        for P in (2, 3, 4, 5):
            plan = make_plan(40, P, mode=mode, causal=True, layout="zigzag")
            assert plan.backward_messages_per_rank() == 2 * plan.messages_per_rank()


@pytest.mark.parametrize("n,chunks", [(1, 1), (3, 3), (5, 4), (8, 4), (8193, 4), (10, 7)])
def test_key_chunks_cover_the_block_in_order(n, chunks):
    cuts = plans.key_chunks(n, chunks)
    assert len(cuts) == chunks and cuts[0][0] == 0 and cuts[-1][1] == n
    assert all(lo < hi for lo, hi in cuts) and all(a[1] == b[0] for a, b in zip(cuts, cuts[1:]))
    assert max(hi - lo for lo, hi in cuts) - min(hi - lo for lo, hi in cuts) <= 1


@pytest.mark.parametrize("S,P,layout,want", [(40, 4, "zigzag", 4), (7, 2, "contiguous", 3), (9, 4, "zigzag", 2),
                                             (5, 5, "striped", 1), (8, 1, "contiguous", 4)])
def test_home_chunks_follow_the_shortest_shard(S, P, layout, want):
    assert plans.home_chunks(make_plan(S, P, layout=layout)) == want


def _pairs(pieces, n_q, n_k):
    """Dense (query, key) visibility of ``plan.pieces``-style pieces, as counts (to catch overlaps)."""
    seen = np.zeros((n_q, n_k), int)
    for a, b, c, d, klo, khi, _ in pieces:
        cols = np.arange(c, d)
        if klo is None:
            seen[a:b, c:d] += 1
        else:
            seen[a:b, c:d] += (cols >= c + klo[:, None]) & (cols < c + khi[:, None])
    return seen


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("causal,window,cu", [(False, None, None), (True, None, None), (True, (5, 0), None),
                                              (False, (3, 4), [0, 9, 9, 30, 43]), (True, None, [0, 17, 43])])
def test_key_chunk_cuts_cover_the_pieces_exactly(layout, causal, window, cu):
    """Cut into key chunks, a block's pieces still see each visible (query, key) pair once, in its own chunk."""
    plan = make_plan(43, 3, layout=layout, causal=causal, window=window, cu_seqlens=cu)
    for rank in range(3):
        for source in range(3):
            pieces = plan.pieces(rank, source)
            n_q, n_k = len(plan.shards[rank]), len(plan.shards[source])
            total = np.zeros((n_q, n_k), int)
            for lo, hi in plans.key_chunks(n_k, plans.HOME_CHUNKS):
                cut = plans.cut_to_keys(pieces, lo, hi)
                assert all(lo <= c < d <= hi and a < b for a, b, c, d, *_ in cut)
                total += _pairs(cut, n_q, n_k)
            np.testing.assert_array_equal(total, _pairs(pieces, n_q, n_k))
            assert total.max() <= 1


def test_chunks_without_work_go_home_right_after_the_first():
    """Causal zigzag, P = 2: rank 1's queries see only the first half of block 0's keys."""
    plan = make_plan(64, 2, layout="zigzag", causal=True)
    order = plans.chunks_in_order(plan.pieces(1, 0), 32, 4)
    assert [chunk for chunk, *_ in order] == [0, 2, 3, 1]
    assert [bool(cut) for *_, cut in order] == [True, False, False, True]
    order = plans.chunks_in_order(plan.pieces(0, 1), 32, 4)  # rank 0's last run sees all of block 1
    assert [chunk for chunk, *_ in order] == [0, 1, 2, 3] and all(cut for *_, cut in order)
    assert [lo for _, lo, _, _ in plans.chunks_in_order([], 32, 4)] == [0, 8, 16, 24]  # a skipped block


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_run_backward_command_verifies():
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "run", "--backward", "--seq-len", "96", "--heads", "4",
                       "--kv-heads", "2", "--dim", "8", "--causal", "--layout", "zigzag", "--mode", "bidirectional")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("VERIFIED") == 1 and "recorded schedule equals the plan: yes" in result.stdout
    assert "backward wall time" in result.stdout and "2.5x forward" in result.stdout


@each_kernel
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tiles", [(5, 3), (16, 7)])
def test_backward_small_tiles(rng, dtype, tiles):
    q, k, v = qkv(rng, (2, 4, 33, 8), (2, 2, 33, 8), dtype)
    dout = rng.standard_normal(q.shape).astype(dtype)
    pos = np.arange(33)
    klo, khi = visible_keys(pos, pos, causal=True, window=(11, 0))
    out, lse = attention_block(q, k, v, None, klo, khi)
    got = attention_block_backward(dout, q, k, v, out, lse, None, klo, khi,
                                   run=BlockRun(tile_q=tiles[0], tile_k=tiles[1]))
    for g, want in zip(got, reference_attention_backward(dout, q, k, v, None, klo, khi)):
        np.testing.assert_allclose(g, want, atol=GRAD_TOL[dtype], rtol=0)
