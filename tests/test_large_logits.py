"""Logits from 1 to 1e30 (float32) and 1e300 (float64): every row that sees a key gets a finite lse
and the softmax of its keys, or the call raises a clear error on every rank.

    python -m pytest -q tests/test_large_logits.py
    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_large_logits.py

The fast path folds each row's offset into the score GEMM; when scores are so
large that this rounding reaches a unit of log2, those rows take the exact
float64 path instead. Checked against the float64 textbook formula on the same
(rounded) inputs, and against torch SDPA when torch is installed.
"""

import numpy as np
import pytest

from mpiring import attention_block, ring_attention, ring_attention_backward
from mpiring.core.kernels import LSE_LIMIT
from mpiring.core.tiles import BlockRun

from conftest import dense_mask, local, naive_attention

pytestmark = pytest.mark.usefixtures("each_kernel")  # every kernel test per GEMM and kernel backend

MAGNITUDES = {np.float32: [1, 1e2, 1e4, 1e5, 1e6, 1e9, 1e12, 1e18, 1e30],
              np.float64: [1, 1e2, 1e4, 1e9, 1e12, 1e18, 1e30, 1e100, 1e300]}
CASES = [(dt, mag) for dt, mags in MAGNITUDES.items() for mag in mags]


def _inputs(dtype, mag, S=160, D=64, seed=0):
    """q, k with logits q.k / sqrt(D) of order ``mag``; v of order 1."""
    rng = np.random.default_rng(seed)
    root = np.sqrt(mag) * D ** 0.25
    q, k = ((rng.standard_normal((2, S, D)) * root).astype(dtype) for _ in range(2))
    v = rng.standard_normal((2, S, D)).astype(dtype)
    return q, k, v


def _allowed(dtype, mag, D=64):
    """Error allowed against the float64 formula: the logits' own rounding in the input dtype.

    Each logit is computed in the input dtype with an error up to about
    D * eps * |logit|, so weights of nearly tied keys may differ by that
    factor, as in torch; at least the suite's tolerance.
    """
    eps = np.finfo(dtype).eps
    return max({np.float32: 1e-5, np.float64: 1e-12}[dtype], 4 * D * eps * mag)


def _reference(q, k, v, mask):
    out = naive_attention(q, k, v, mask)
    s = q.astype(np.float64) @ np.swapaxes(k.astype(np.float64), -1, -2) / np.sqrt(q.shape[-1])
    s = np.where(mask, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    lse = (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))[..., 0]
    return out, lse


def _torch_error(q, k, v, mask, ref):
    torch = pytest.importorskip("torch")
    t = [torch.from_numpy(np.ascontiguousarray(a)) for a in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.from_numpy(mask)).numpy()
    return float(np.nanmax(np.abs(out - ref)))


@pytest.mark.parametrize("dtype,mag", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_rows_stay_finite_and_right(dtype, mag, causal):
    q, k, v = _inputs(dtype, mag)
    mask = dense_mask(q.shape[-2], causal)
    klo, khi = (0 * np.arange(q.shape[-2]), np.arange(q.shape[-2]) + 1) if causal else (None, None)
    ref, ref_lse = _reference(q, k, v, mask)
    for tiles in ((None, None), (32, 16)):  # default tiles, and small ones: many tiles per row
        out, lse = attention_block(q, k, v, None, klo, khi, run=BlockRun(*tiles))
        assert np.isfinite(lse).all(), f"{int((~np.isfinite(lse)).sum())} rows with a non-finite lse"
        err = float(np.max(np.abs(out - ref)))
        assert err <= _allowed(dtype, mag), f"out error {err:.3e}"
        lse_err = float(np.max(np.abs(lse - ref_lse) / np.maximum(1, np.abs(ref_lse))))
        assert lse_err <= 4 * np.finfo(dtype).eps * q.shape[-1], f"lse relative error {lse_err:.3e}"


@pytest.mark.parametrize("dtype,mag", [(np.float32, 1e2), (np.float32, 1e9), (np.float32, 1e30),
                                       (np.float64, 1e18), (np.float64, 1e300)])
def test_no_worse_than_torch(dtype, mag):
    """Against the same float64 reference, the kernel's error is at most torch SDPA's (or the tolerance)."""
    q, k, v = _inputs(dtype, mag)
    mask = dense_mask(q.shape[-2], causal=True)
    ref, _ = _reference(q, k, v, mask)
    theirs = _torch_error(q, k, v, mask, ref)
    n = q.shape[-2]
    out, _ = attention_block(q, k, v, None, np.zeros(n, int), np.arange(n) + 1)
    ours = float(np.max(np.abs(out - ref)))
    assert ours <= 2 * theirs + {np.float32: 1e-5, np.float64: 1e-12}[dtype], (ours, theirs)


@pytest.mark.mpi
def test_a_huge_scale_is_right_and_an_overflowing_one_is_refused(comm):
    rng = np.random.default_rng(1)
    Q, K, V = (rng.standard_normal((1, 2, 6 * comm.size, 16)) for _ in range(3))
    q, k, v = (local(x, comm) for x in (Q, K, V))
    out, lse = ring_attention(q, k, v, comm, causal=True, scale=1e300)
    mask = dense_mask(Q.shape[-2], causal=True)
    s = np.where(mask, Q @ np.swapaxes(K, -1, -2), -np.inf)  # scale > 0 does not move the argmax
    ref = np.take_along_axis(V, np.argmax(s, axis=-1)[..., None], axis=-2)  # each row picks its top key
    assert np.isfinite(lse).all()
    assert np.max(np.abs(out - local(ref, comm))) < 1e-12
    with pytest.raises(ValueError, match="logits may overflow float64"):
        ring_attention(q, k, v, comm, causal=True, scale=1e306)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype,mag", [(np.float32, 1e9), (np.float32, 1e30), (np.float64, 1e300)])
def test_ring_with_huge_logits(comm, dtype, mag):
    """Through the ring (every layout): rows stay finite and right, as in the kernel."""
    for layout in ("contiguous", "zigzag", "striped"):
        Q, K, V = (a[None] for a in _inputs(dtype, mag, S=24 * comm.size + 1, seed=comm.size))
        mask = dense_mask(Q.shape[-2], causal=True)
        ref, ref_lse = _reference(Q, K, V, mask)
        q, k, v = (local(x, comm, layout) for x in (Q, K, V))
        out, lse = ring_attention(q, k, v, comm, causal=True, layout=layout)
        assert np.isfinite(lse).all()
        assert np.max(np.abs(out - local(ref, comm, layout))) <= _allowed(dtype, mag)


@pytest.mark.mpi
def test_backward_refuses_an_lse_it_cannot_use(comm):
    """Gradients come from exp(scale q.k - lse): beyond LSE_LIMIT they would be wrong, so every rank raises."""
    Q, K, V = _inputs(np.float32, 1e6, S=8 * comm.size)
    q, k, v = (local(x[None], comm) for x in (Q, K, V))
    out, lse = ring_attention(q, k, v, comm, causal=True)
    assert np.abs(lse).max() > LSE_LIMIT[np.dtype(np.float32)]
    with pytest.raises(ValueError, match="lse reaches"):
        ring_attention_backward(np.ones_like(out), q, k, v, out, lse, comm, causal=True)
