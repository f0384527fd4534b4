"""Seed 001's simulator contract, and every variant in one process."""

import math

import numpy as np
import pytest

from mpiring import LAYOUTS, MODES, ring_attention_simulate, simulate

from conftest import dense_mask, naive_attention, qkv, tol


def test_uniform_attention_by_hand():
    Q = np.zeros((4, 2))
    K = np.arange(8.0).reshape(4, 2)
    V = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    out, schedule = ring_attention_simulate(Q, K, V, 4)
    assert np.array_equal(out, np.tile([4.0, 5.0], (4, 1)))  # equal weights: the mean of V
    assert schedule == [[0, 1, 2, 3], [3, 0, 1, 2], [2, 3, 0, 1], [1, 2, 3, 0]]


def test_two_devices_by_hand():
    eye = np.eye(2)
    out, schedule = ring_attention_simulate(eye, eye, eye, 2)
    w = math.exp(1 / math.sqrt(2)) / (math.exp(1 / math.sqrt(2)) + 1)  # softmax([1, 0] / sqrt 2)[0]
    assert np.array_equal(out, np.round([[w, 1 - w], [1 - w, w]], 4))
    assert schedule == [[0, 1], [1, 0]]


@pytest.mark.parametrize("P", [1, 2, 3, 4, 6])
def test_equals_standard_attention_rounded(rng, P):
    Q, K, V = qkv(rng, (12, 5))
    out, schedule = ring_attention_simulate(Q, K, V, P)
    assert out.shape == (12, 5) and isinstance(out, np.ndarray)
    assert np.max(np.abs(out - naive_attention(Q, K, V))) <= 5e-5
    assert np.array_equal(out, np.round(out, 4))
    assert schedule == [[(d - s) % P for d in range(P)] for s in range(P)]


@pytest.mark.parametrize("args,match", [
    ((np.ones((10, 4)), np.ones((10, 4)), np.ones((10, 4)), 3), "not divisible"),
    ((np.ones((8, 4)), np.ones((8, 4)), np.ones((8, 4)), 0), "positive integer"),
    ((np.ones((8, 4)), np.ones((8, 4)), np.ones((8, 4)), 2.0), "positive integer"),
    ((np.ones((8, 4)), np.ones((6, 4)), np.ones((6, 4)), 2), "mismatched"),
    ((np.ones((8, 4)), np.ones((8, 3)), np.ones((8, 4)), 2), "mismatched"),
    ((np.ones((8, 4)), np.ones((8, 4)), np.ones((7, 4)), 2), "mismatched"),
    ((np.ones(8), np.ones(8), np.ones(8), 2), "2-D"),
    ((np.ones((8, 4)), np.ones((8, 4)), np.array([["a"] * 4] * 8), 2), "real numbers"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        ring_attention_simulate(*args)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("causal,window,cu", [
    (False, None, None), (True, None, None), (True, (5, 0), None), (False, (4, 3), None),
    (True, None, [0, 3, 3, 20, 29, 37]), (False, (6, 6), [0, 19, 37]),
])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_every_variant_equals_reference(rng, layout, mode, causal, window, cu, P):
    Q, K, V = qkv(rng, (2, 4, 37, 8), (2, 2, 37, 8))
    out, lse, schedule = simulate(Q, K, V, P, causal=causal, layout=layout, mode=mode, window=window,
                                  cu_seqlens=cu)
    expected = naive_attention(Q, K, V, dense_mask(37, causal, window, cu))
    np.testing.assert_allclose(out, expected, atol=tol(np.float64), rtol=0)


@pytest.mark.parametrize("mode", MODES)
def test_positions_and_frame_causal_blocks(mode):
    """Random uneven unsorted positions and a frame-causal window, against the reference mask."""
    from mpiring import balance
    from mpiring.core.reference import definition_mask

    rng = np.random.default_rng(5)
    S = 45
    Q, K, V = qkv(rng, (2, 4, S, 8), (2, 2, S, 8))
    parts = [rng.permutation(p) for p in balance(S, 3, causal=True, causal_block=4, method="greedy")]
    mask = dict(causal=True, causal_block=4, window=(11, 0))
    out, lse, _ = simulate(Q, K, V, 3, mode=mode, positions=parts, **mask)
    pos = np.arange(S)
    want = naive_attention(Q, K, V, definition_mask(pos, pos, **mask))
    assert np.max(np.abs(out - want)) < tol(np.float64)
