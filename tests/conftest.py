import numpy as np
import pytest

# agreement with the float64 single-process reference, per input dtype
TOL = {np.float64: 1e-12, np.float32: 1e-5}


# (q shape, k/v shape or None for the same): 2-D, (batch, heads, seq, dim), grouped-query g = 2, multi-query g = 4
SHAPES = [((17, 8), None), ((2, 3, 33, 16), None), ((2, 4, 21, 8), (2, 2, 21, 8)), ((1, 4, 19, 8), (1, 1, 19, 8))]


def tol(dtype):
    return TOL[np.dtype(dtype).type]


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name: reproducible, different per test."""
    return np.random.default_rng(_seed(request.node.name))


def _seed(name):
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 2**32


def qkv(rng, shape_q, shape_kv=None, dtype=np.float64, scale=1.0):
    """Random q, k, v with the given shapes (k and v share shape_kv)."""
    shape_kv = shape_kv or shape_q
    q = (rng.standard_normal(shape_q) * scale).astype(dtype)
    k = (rng.standard_normal(shape_kv) * scale).astype(dtype)
    v = rng.standard_normal(shape_kv).astype(dtype)
    return q, k, v


def naive_attention(q, k, v, mask=None, scale=None):
    """The textbook formula, as plain as it gets: softmax(q k^T / sqrt(d)) v in float64."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    if q.ndim >= 3 and q.shape[-3] != k.shape[-3]:  # grouped-query: repeat K/V heads
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    den = p.sum(axis=-1, keepdims=True)
    return np.where(den > 0, p @ v / np.where(den > 0, den, 1), 0.0)


def naive_attention_backward(dout, q, k, v, mask=None, scale=None):
    """Dense float64 gradients (dq, dk, dv) of ``naive_attention``, from the textbook formulas."""
    dout, q, k, v = (np.asarray(a, np.float64) for a in (dout, q, k, v))
    g = q.shape[-3] // k.shape[-3] if q.ndim >= 3 else 1
    kr, vr = (np.repeat(a, g, axis=-3) if g > 1 else a for a in (k, v))
    scale = 1 / np.sqrt(q.shape[-1]) if scale is None else scale
    s = q @ np.swapaxes(kr, -1, -2) * scale
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(m), m, 0))
    den = e.sum(axis=-1, keepdims=True)
    p = e / np.where(den > 0, den, 1)  # rows that see no key: all zero, no gradient
    dp = dout @ np.swapaxes(vr, -1, -2)
    ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True))
    dq = ds @ kr * scale
    dk = np.swapaxes(ds, -1, -2) @ q * scale
    dv = np.swapaxes(p, -1, -2) @ dout
    if g > 1:  # each K/V head gets the sum over its group of query heads
        dk = dk.reshape(k.shape[:-3] + (k.shape[-3], g) + k.shape[-2:]).sum(axis=-3)
        dv = dv.reshape(v.shape[:-3] + (v.shape[-3], g) + v.shape[-2:]).sum(axis=-3)
    return dq, dk, dv


def dense_mask(seq_len, causal=False, window=None, cu_seqlens=None):
    """Boolean (S, S) mask written independently of mpiring.masks."""
    i = np.arange(seq_len)[:, None]
    j = np.arange(seq_len)[None, :]
    ok = np.ones((seq_len, seq_len), bool)
    if causal:
        ok &= j <= i
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i - left
        if right >= 0:
            ok &= j <= i + right
    if cu_seqlens is not None:
        doc = np.zeros(seq_len, int)
        for d, (a, b) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            doc[a:b] = d
        ok &= doc[:, None] == doc[None, :]
    return ok


@pytest.fixture
def comm():
    """The world communicator (size 1 in the serial run, P under mpiexec -n P)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def local(x, comm, layout="contiguous"):
    """This rank's contiguous shard of a full array."""
    from mpiring import shard

    return np.ascontiguousarray(shard(x, comm.size, comm.rank, layout))
