"""The block kernel and the log-sum-exp merge against the textbook formula."""

import warnings

import numpy as np
import pytest

from mpiring.core.backends import attention_block
from mpiring.core.kernels import merge, pad_ones
from mpiring.core.reference import reference_attention
from mpiring.core.tiles import BlockRun
from mpiring.plans.visibility import visible_keys

from conftest import SHAPES, dense_mask, naive_attention, qkv, tol

pytestmark = pytest.mark.usefixtures("each_kernel")  # every kernel test per GEMM and kernel backend


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape_q,shape_kv", SHAPES)
def test_block_matches_textbook(rng, dtype, shape_q, shape_kv):
    q, k, v = qkv(rng, shape_q, shape_kv, dtype)
    out, lse = attention_block(q, k, v)
    assert out.dtype == dtype and lse.dtype == dtype
    assert out.shape == q.shape and lse.shape == q.shape[:-1]
    np.testing.assert_allclose(out, naive_attention(q, k, v), atol=tol(dtype), rtol=0)


@pytest.mark.parametrize("causal,window,cu", [
    (True, None, None), (False, (3, 2), None), (True, (4, -1), None),
    (False, None, [0, 5, 5, 12, 30]), (True, (2, 0), [0, 1, 30]),
])
def test_block_masks(rng, causal, window, cu):
    q, k, v = qkv(rng, (2, 30, 8))
    pos = np.arange(30)
    klo, khi = visible_keys(pos, pos, causal=causal, window=window or (-1, -1),
                            cu_seqlens=None if cu is None else np.array(cu))
    out, lse = attention_block(q, k, v, None, klo, khi)
    np.testing.assert_allclose(out, naive_attention(q, k, v, dense_mask(30, causal, window, cu)), atol=1e-12)
    np.testing.assert_allclose(reference_attention(q, k, v, None, klo, khi)[0], out, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("factor", [100.0, 1000.0])
def test_extreme_logits_stay_finite(rng, dtype, factor):
    q, k, v = qkv(rng, (2, 16, 8), dtype=dtype)
    q *= dtype(factor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention_block(q, k, v)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    np.testing.assert_allclose(out, naive_attention(q, k, v), atol=1e-4 if dtype == np.float32 else 1e-10)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_fully_masked_rows_are_neutral(rng, dtype):
    q, k, v = qkv(rng, (6, 4), dtype=dtype)
    klo = np.array([0, 3, 2, 6, 0, 5])
    khi = np.array([6, 3, 4, 6, 0, 6])  # rows 1, 3 and 4 see nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = attention_block(q, k, v, None, klo, khi)
        empty = [1, 3, 4]
        assert np.all(out[empty] == 0) and np.all(np.isneginf(lse[empty]))
        # merging two neutral partials, or a neutral with a real one, gives no NaN
        o2, l2 = merge(out, lse, out, lse)
        assert np.all(o2[empty] == 0) and np.all(np.isneginf(l2[empty]))
        full, full_lse = attention_block(q, k, v)
        o3, l3 = merge(out * 0, np.full_like(lse, -np.inf), full, full_lse)
    np.testing.assert_allclose(o3, full, atol=tol(dtype), rtol=0)
    np.testing.assert_allclose(l3, full_lse, atol=tol(dtype), rtol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_merge_of_parts_equals_whole_in_any_order(rng, dtype):
    q, k, v = qkv(rng, (3, 20, 8), (3, 40, 8), dtype)
    whole, whole_lse = attention_block(q, k, v)
    cuts = [0, 7, 8, 25, 40]
    parts = [attention_block(q, k[..., a:b, :], v[..., a:b, :]) for a, b in zip(cuts[:-1], cuts[1:])]
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 3, 1, 0]):
        out, lse = np.zeros_like(whole), np.full_like(whole_lse, -np.inf)
        for i in order:
            out, lse = merge(out, lse, *parts[i])
        np.testing.assert_allclose(out, whole, atol=tol(dtype), rtol=0)
        np.testing.assert_allclose(lse, whole_lse, atol=10 * tol(dtype), rtol=0)


def test_lse_is_log_sum_exp(rng):
    q, k, v = qkv(rng, (5, 4), (9, 4))
    _, lse = attention_block(q, k, v, scale=0.3)
    expected = np.log(np.exp(q @ k.T * 0.3).sum(axis=-1))
    np.testing.assert_allclose(lse, expected, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tiles", [(5, 3), (7, 16), (64, 4)])
@pytest.mark.parametrize("factor", [1.0, 1000.0])
def test_small_tiles_take_every_path(rng, dtype, tiles, factor):
    """Tiles that do not divide the lengths, empty and partial tiles, and the rescaling path."""
    q, k, v = qkv(rng, (2, 4, 45, 8), (2, 2, 45, 8), dtype)
    q *= dtype(factor)  # x1000: scores far above the first key's, so tiles must rescale
    pos = np.arange(45)
    klo, khi = visible_keys(pos, pos, causal=True, window=(9, 0), cu_seqlens=np.array([0, 20, 20, 45]))
    out, lse = attention_block(q, k, v, None, klo, khi, run=BlockRun(*tiles))
    ref, ref_lse = reference_attention(q, k, v, None, klo, khi)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))
    atol = tol(dtype) * (1 if factor == 1 else 100)
    np.testing.assert_allclose(out, ref, atol=atol, rtol=0)
    np.testing.assert_allclose(lse, ref_lse, rtol=10 * tol(dtype), atol=0)
    np.testing.assert_allclose(out, naive_attention(q, k, v, dense_mask(45, True, (9, 0), [0, 20, 20, 45])),
                               atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("tiles", [(5, 3), (64, 16)])
def test_padded_kv_and_merge_into_accumulators(rng, dtype, tiles):
    """The ring's way to call the kernel: [k | 1]^T, [v | 1]^T views of bigger buffers, tiles merged into float64."""
    q, k, v = qkv(rng, (2, 4, 45, 8), (2, 2, 45, 8), dtype)
    pos = np.arange(45)
    klo, khi = visible_keys(pos, pos, causal=True, window=(9, 0), cu_seqlens=np.array([0, 20, 20, 45]))
    whole, whole_lse = attention_block(q, k, v, None, klo, khi, run=BlockRun(*tiles))
    # padded blocks as views of a longer receive buffer, the row of ones set once
    kbuf, vbuf = (pad_ones(np.concatenate([a, a[..., :5, :]], axis=-2)) for a in (k, v))
    out = np.zeros(q.shape, np.float64)
    lse = np.full(q.shape[:-1], -np.inf)
    for a, b in [(30, 45), (0, 7), (7, 30)]:  # key blocks, in any order
        res = attention_block(q, kbuf[..., a:b], vbuf[..., a:b], None, klo - a, khi - a, padded=True,
                              into=(out, lse), run=BlockRun(*tiles))
        assert res[0] is out and res[1] is lse
    assert np.all(kbuf[..., -1, :] == 1) and np.all(vbuf[..., -1, :] == 1)  # the kernel never writes them
    np.testing.assert_array_equal(kbuf[..., :-1, :45], np.swapaxes(k, -1, -2))
    np.testing.assert_allclose(out, whole, atol=tol(dtype), rtol=0)
    np.testing.assert_allclose(lse, whole_lse, atol=10 * tol(dtype), rtol=0)
    np.testing.assert_allclose(out, reference_attention(q, k, v, None, klo, khi)[0], atol=tol(dtype), rtol=0)


def test_merge_into_needs_a_view(rng):
    """Accumulators that cannot be reshaped in place raise instead of silently receiving nothing."""
    q, k, v = qkv(rng, (2, 3, 10, 4), (2, 3, 10, 4))
    out = np.zeros((4, 10, 3, 2)).transpose(3, 2, 1, 0)  # (2, 3, 10, 4), not reshapeable to (6, 1, 10, 4)
    lse = np.full((2, 3, 10), -np.inf)
    with pytest.raises(AttributeError):
        attention_block(q, k, v, into=(out, lse))


def test_a_window_visits_only_its_key_tiles():
    """With a sliding window over a long block, row_block looks at the few key tiles the rows see, not all."""
    from mpiring.core.tiles import Tiles

    sk, tk, window = 1 << 20, 256, 300
    rows = np.arange(sk)
    lo, hi = np.maximum(rows - window, 0), rows + 1
    tiles = Tiles(lo, hi, sk, tk, np.float32)
    visited = [tiles.row_block(a, a + 512) for a in range(0, sk, 1 << 16)]
    assert tiles.examined <= len(visited) * (512 + window) // tk + 2 * len(visited)
    for a, found in zip(range(0, sk, 1 << 16), visited):
        keys = set().union(*(range(c, d) for c, d, *_ in found))
        assert keys == set(range(max(a - window, 0), a + 512))  # exactly the visible keys, nothing else


def test_tile_keywords_moved_into_run_still_work_with_a_warning(rng):
    """``attention_block(tile_q=, tile_k=, progress=)`` (before ``run=BlockRun``): the same bits, a
    DeprecationWarning; any other keyword is still a TypeError."""
    q, k, v = (rng.standard_normal((2, 40, 16)) for _ in range(3))
    calls = []
    with pytest.warns(DeprecationWarning, match="tile_q=, tile_k=, progress="):
        old = attention_block(q, k, v, tile_q=8, tile_k=16, progress=lambda: calls.append(1))
    new = attention_block(q, k, v, run=BlockRun(tile_q=8, tile_k=16))
    for a, b in zip(old, new):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(TypeError, match="tile_size"):
        attention_block(q, k, v, tile_size=8)
