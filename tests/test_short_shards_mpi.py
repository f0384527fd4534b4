"""Forward and backward through the real ring with few tokens per rank, against an independent reference.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_short_shards_mpi.py

Bugs live at the boundaries: a backward that was exact at 64 tokens per rank
was wrong at 8 (one hop home cut into 4 key chunks of 2 keys each). So the
tokens per rank are swept from 1 past the hop-home chunking and past the
kernel's tiles (made small here, and at their defaults for a few larger
sizes), with uneven lengths, for every layout x mode and every kind of mask,
with and without grouped-query heads. The reference is the dense textbook
formula over a dense mask written from the definitions (conftest), sharing
no code with mpiring.
"""

import itertools

import numpy as np
import pytest

from mpiring import LAYOUTS, MODES, reference_attention, ring_attention, ring_attention_backward
from mpiring.core import kernels, tiles

from conftest import GRAD_TOL, dense_mask, local, naive_attention, naive_attention_backward

pytestmark = pytest.mark.mpi

TOL = GRAD_TOL[np.float64]  # float64, absolute, on values of order 1 (outputs and gradients alike)


def _masks(S):
    """(causal, window, cu_seqlens) cases over S tokens: windows narrower and wider than S, documents."""
    cu = np.array(sorted({0, min(3, S), S // 2, S}))
    return [
        (False, None, None), (True, None, None), (True, (3, 0), None), (False, (2, 5), None),
        (True, (S + 5, 0), None), (True, None, cu), (False, (4, 4), cu), (False, (0, 0), None),
    ]


def _check(comm, S, layout, mode, causal, window, cu, heads, kv_heads, seed):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((1, heads, S, 8))
    K, V = (rng.standard_normal((1, kv_heads, S, 8)) for _ in range(2))
    dOut = rng.standard_normal(Q.shape)
    mask = dense_mask(S, causal, window, cu)
    out_ref = naive_attention(Q, K, V, mask)
    grads_ref = naive_attention_backward(dOut, Q, K, V, mask)
    options = dict(causal=causal, window=window, cu_seqlens=cu, layout=layout, mode=mode)
    q, k, v, dout = (local(x, comm, layout) for x in (Q, K, V, dOut))
    out, lse = ring_attention(q, k, v, comm, **options)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, **options)
    case = f"S={S} P={comm.size} {layout} {mode} causal={causal} window={window} cu={cu} heads={heads}/{kv_heads}"
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out,) + grads, (out_ref,) + grads_ref):
        err = float(np.max(np.abs(got - local(want, comm, layout))))
        assert err < TOL, f"{name} error {err:.3e} ({case})"


@pytest.fixture
def small_tiles(monkeypatch):
    """Kernel tiles of 4 keys x 8 query rows (float64): tiles are crossed at a handful of tokens."""
    monkeypatch.setattr(tiles, "TILE_K", 4)
    monkeypatch.setattr(tiles, "TILE_BYTES", 8 * 4 * 8)


QUICK_N = {1, 2, 3, 4, 5, 8, 9, 16, 17, 33}  # every tile edge's both sides; n mod 8 takes 0-5: every mask meets each
AT_3 = {1, 4, 5, 9, 17}  # the quick suite's P = 3 (and P = 1, 2); QUICK_N's others at P = 4: each n once beyond 2


def _quick(n):
    """n's case: every size in the quick suite at P <= 2, and P = 3 or 4 (half the tile edges each: the reference
    of every rank is the whole sequence's, the cost of these stages); not in QUICK_N: --full only."""
    if n not in QUICK_N:
        return pytest.param(n, marks=pytest.mark.full)
    return pytest.param(n, marks=pytest.mark.ranks(1, 2, 3 if n in AT_3 else 4))


@pytest.mark.parametrize("n", [_quick(n) for n in [1, 2, 3, 4, 5, 7, 8, 9, 11, 12, 15, 16, 17, 20, 23, 33]])
def test_every_layout_mode_and_mask_at_n_tokens_per_rank(comm, small_tiles, n):
    """n tokens per rank (plus 0, 1 or P-1 extra tokens: uneven shards), every layout x mode, masks in turn."""
    P = comm.size
    combos = list(itertools.product(LAYOUTS, MODES))
    for i, (layout, mode) in enumerate(combos):
        S = n * P + (0, 1, P - 1)[i % 3]
        masks = _masks(S)
        for j in range(3):  # three masks per layout x mode, rotating so every mask meets every combination
            causal, window, cu = masks[(3 * i + j + n) % len(masks)]
            heads, kv_heads = ((2, 2), (4, 2), (3, 1))[(i + j) % 3]
            _check(comm, S, layout, mode, causal, window, cu, heads, kv_heads, seed=1000 * n + 10 * i + j)


@pytest.mark.parametrize("n", [8, 13])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_masks_where_the_backward_failed(comm, layout, n):
    """The reported failures: S = 8P and 13P + 1, every mode x mask, default tiles."""
    S = n * comm.size + (n == 13)
    for mode in MODES:
        for causal, window, cu in _masks(S):
            _check(comm, S, layout, mode, causal, window, cu, 2, 2, seed=S)


@pytest.mark.parametrize("n", [pytest.param(129, marks=pytest.mark.full),
                               pytest.param(300, marks=pytest.mark.ranks(1, 2))])
def test_past_the_default_tiles(comm, n):
    """More tokens per rank than one default tile (256 keys, 256 float64 query rows). The quick suite stops at
    P = 2: at P = 3 and 4 every rank's dense reference of the whole sequence made this one test a seventh to a
    tenth of its stage; there the tests above cross tiles at every size (tiles made small: the same loops)."""
    S = n * comm.size + 1
    for i, (layout, mode) in enumerate(itertools.product(LAYOUTS, MODES)):
        causal, window, cu = _masks(S)[i % 8]
        _check(comm, S, layout, mode, causal, window, cu, 2, 1, seed=i)


def test_kernel_backward_with_one_row_views():
    """The kernel reads strided one-row views of lse and delta correctly (np.negative misread them)."""
    rng = np.random.default_rng(3)
    q, k, v, dout = (rng.standard_normal((1, 2, 8, 8)) for _ in range(4))
    out, lse = reference_attention(q, k, v)
    delta = np.sum(dout * out, axis=-1)
    want = kernels.attention_block_backward(dout[..., :1, :], q[..., :1, :], k[..., 5:6, :], v[..., 5:6, :],
                                            out[..., :1, :], np.ascontiguousarray(lse[..., :1]), 0.35,
                                            delta=np.ascontiguousarray(delta[..., :1]))
    got = kernels.attention_block_backward(dout[..., :1, :], q[..., :1, :], k[..., 5:6, :], v[..., 5:6, :],
                                           out[..., :1, :], lse[..., :1], 0.35, delta=delta[..., :1])
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
