"""The block kernel on PyTorch's CPU flash-attention ops: the ``torch`` kernel backend. No MPI.

``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu`` returns the
output and the log-sum-exp a ring merges with; its ``_backward`` takes the
final (merged) out and lse, as ring-flash-attention calls flash-attn's. Both
take the arrays with no copy (``torch.from_numpy``) and run on as many
threads as NumPy's BLAS has now (one per rank under ``mpiexec``).

What the ops do not take, this module does not pass them (``supports``: the
NumPy kernel does those blocks): head dims of V other than of Q and K, empty
blocks (the op divides by zero there), scores too large for the fast path
(``kernels.EXACT_ABOVE``: the NumPy kernel takes them in float64), non-finite
inputs, and in the backward an lse beyond ``kernels.LSE_LIMIT`` (refused there).

A klo/khi mask is cut into calls the op computes exactly: per chunk of query
rows, the keys every row sees (no mask), a causal triangle (``is_causal``,
top-left aligned: row i sees keys c0..c0+i), or else an additive 0/-inf mask of
the chunk's rows and the keys they see (``SHORT_CALL_SCORES`` entries at most).
The forward merges every call's (out, lse) into the running pair (``merge``).

While a call runs, a helper thread polls the rank's messages
(``tiles.Progress.during``; the op releases the GIL), so calls can be long
(``CALL_SCORES``) without leaving transfers unattended. The ring keeps K/V for
this backend as (..., n, d) (``buffers.PlainBuffers``); a block in the NumPy
kernel's [x | 1]^T form costs one contiguous copy (``_tensors``).

The op allocates its outputs on every call (it has no ``out=``), and glibc
keeps what torch frees: its mmap threshold rises to the size of the freed
outputs, so the next calls take their memory from the heap, which grew by
tens of MB a warm call. Each block ends with ``machine.trim_heap`` (``malloc_trim``);
inside a ring call's loop (``machine.one_trim``) the trims wait for its end, so the
heap's free pages serve the next blocks instead of being faulted in again
(docs/performance.md §17, §23).
"""

import functools
import importlib.util
import warnings

import numpy as np

from ..kernels import EXACT_ABOVE, LOG2E, LSE_LIMIT, merge
from ..tiles import (
    Progress,
    Shapes,
    as_view,
    default_scale,
    kernel_dtype,
    mask_arrays,
    max_abs,
    scratch,
    tile_max_norm,
    tile_max_norm_t,
)
from .machine import trim_heap
from .threads import blas_threads

__all__ = ["installed", "available", "supports", "delta_matches", "forward", "backward", "CALL_SCORES"]

# Score entries (heads x rows x keys) per call of the op. A helper thread polls the rank's messages
# while a call runs (``tiles.Progress.during``), so calls can be long: 2^28 entries, 4096 query rows of a
# 8-head x 8192-key block (longer calls are faster, docs/performance.md §14). A call with an additive mask,
# or without that helper (an MPI below MPI_THREAD_SERIALIZED), takes 2^25: the mask's memory, and polls
# between calls.
CALL_SCORES = 1 << 28
SHORT_CALL_SCORES = 1 << 25
# A causal triangle's backward goes to the op in halves down to this many rows: two triangles beside the
# rectangle under the diagonal, which the op computes without its masked overrun (§23: a 2048-row triangle
# 179 -> 162 ms on one Zen 4 core). Not the forward's: the halves' merges cost what they save. None: one call.
TRIANGLE_ROWS = 128


@functools.cache
def _torch():
    """The torch module, or None when it is not installed or has no CPU flash-attention op."""
    try:
        import torch
    except ImportError:
        return None
    ops = torch.ops.aten
    if not (hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu")
            and hasattr(ops, "_scaled_dot_product_flash_attention_for_cpu_backward")):
        return None
    return torch


def installed():
    """Whether torch is installed here, answered without importing it (``available`` imports it)."""
    try:
        return importlib.util.find_spec("torch") is not None
    except ValueError:  # a module "torch" without a spec (sys.modules["torch"] = None hides it)
        return False


def available():
    """Whether this process can use the torch backend."""
    return _torch() is not None


def _threads(torch):
    """Torch's intra-op threads as many as the BLAS's now (one per rank when ranks share the cores).

    Set on every call (0.1 us), not only when ``torch.get_num_threads()`` differs: that reads OpenMP's count,
    which threadpoolctl restores when a ``threads=`` limit ends while torch's own MKL keeps the count it was
    set to. Torch then reported 2 threads while its float64 backward ran with MKL's 1, and a block gave other
    bits after a call with ``threads=1`` than in a fresh process (tests/test_history_mpi.py with the torch
    backend).
    """
    torch.set_num_threads(blas_threads())


def _fits(sh, scale):
    """Finite inputs whose scores stay in the range where the op's float tiles are exact (kernels' bound).

    The bound is on the largest |score|, the product of the largest row norms of q and k. A row's norm is at
    most sqrt(D) times its largest |entry|: where that cheaper product is under half the bound, the norms are
    not computed (two min/max passes instead of a float64 square per entry; the answer is the same).
    """
    if sh.sq == 0 or sh.sk == 0 or sh.d != sh.dv:
        return False
    k = sh.k if hasattr(sh, "k") else None
    kd = k if k is not None else sh.kt[:, :sh.d]
    v = sh.v if k is not None else sh.vt[:, :sh.dv]
    if not np.isfinite(max_abs(v)):
        return False
    if sh.d * max_abs(sh.q) * max_abs(kd) * abs(scale) * LOG2E <= EXACT_ABOVE[sh.dtype] / 2:  # nan: false
        return True
    kn = tile_max_norm(k, max(1, sh.sk)) if k is not None else tile_max_norm_t(kd, max(1, sh.sk))
    qn = tile_max_norm(sh.q, max(1, sh.sq))
    return bool(qn.max() * kn.max() * abs(scale) * LOG2E <= EXACT_ABOVE[sh.dtype])


def supports(q, k, v, scale=None, *, padded=False, lse=None):
    """Whether the op computes this block exactly (the forward, or with ``lse`` the backward)."""
    if _torch() is None:
        return False
    sh = Shapes(q, k, v, padded)
    scale = default_scale(sh.d) if scale is None else float(scale)
    if lse is not None:
        lse = np.asarray(lse)
        finite = lse[np.isfinite(lse)]
        if finite.size and np.abs(finite).max() > LSE_LIMIT[sh.dtype]:
            return False
    return _fits(sh, scale)


def delta_matches(dout, out, delta):
    """Whether ``delta`` is rowsum(dout * out) up to rounding in its dtype or the compute dtype (None: it is)."""
    if delta is None:
        return True
    dout, out, delta = np.asarray(dout), np.asarray(out), np.asarray(delta)
    prod = dout.astype(np.float64) * out
    eps = max(np.finfo(kernel_dtype(dout.dtype)).eps, np.finfo(kernel_dtype(delta.dtype)).eps,
              np.finfo(delta.dtype).eps if delta.dtype.kind == "f" else 0)
    bound = 8 * eps * np.abs(prod).sum(axis=-1) + np.finfo(np.float64).tiny
    return bool(np.all(np.abs(delta.astype(np.float64) - prod.sum(axis=-1)) <= bound))


def _calls(lo, hi, sq, sk, rows_per_call, triangle_rows=None):
    """The op's calls for a klo/khi mask: ``(a, e, c, d, causal, mask, dead)`` per call.

    Query rows a:e against keys c:d; ``causal``: top-left triangle (in halves down to ``triangle_rows``,
    ``_triangle``); ``mask``: None or a bool (e-a, d-c) array of visible pairs; ``dead``: None or the rows of
    a:e that see no key of c:d.
    """
    for a in range(0, sq, rows_per_call):
        e = min(a + rows_per_call, sq)
        if lo is None:
            yield a, e, 0, sk, False, None, None
            continue
        rlo, rhi = lo[a:e], hi[a:e]
        first, c0 = int(rlo[0]), int(rhi[0]) - 1
        if _unmasked(rlo, rhi, sk):
            if c0 > first:                             # keys every row of the chunk sees
                yield a, e, first, c0, False, None, None
            if c0 < sk and rhi[-1] > rhi[0]:           # the triangle: row a+i sees keys c0..c0+i
                yield from _triangle(a, e, c0, int(rhi[-1]), triangle_rows)
            elif c0 < sk:                              # one row, or the triangle clipped to one key column
                yield a, e, c0, c0 + 1, False, None, None
            continue
        sees = rhi > rlo
        if not sees.any():
            continue
        c, d = int(rlo[sees].min()), int(rhi[sees].max())
        cols = np.arange(c, d)
        yield a, e, c, d, False, (cols >= rlo[:, None]) & (cols < rhi[:, None]), ~sees


def _triangle(a, e, c, d, rows):
    """Calls for rows a:e where row a+i sees keys c..c+i (clipped at d): halves, the rectangle under the
    diagonal between them, while the triangle has more than ``rows`` rows and is not clipped at d."""
    half = (e - a) // 2
    if rows is None or e - a <= rows or c + (e - a) > d:
        yield a, e, c, d, True, None, None
        return
    yield from _triangle(a, a + half, c, c + half, rows)
    yield a + half, e, c, c + half, False, None, None
    yield from _triangle(a + half, e, c + half, d, rows)


def _unmasked(lo, hi, sk):
    """Whether rows lo/hi are keys every row sees, then a top-left triangle: calls without a mask."""
    first, c0 = int(lo[0]), int(hi[0]) - 1
    triangle = np.minimum(np.arange(c0 + 1, c0 + 1 + len(hi)), sk)  # row i sees keys < c0 + 1 + i
    return bool(np.all(lo == first)) and first <= c0 and np.array_equal(hi, triangle)


def _rows_per_call(sh, lo, hi, threaded):
    """Query rows per call: long calls when a helper thread polls meanwhile and no call needs a mask."""
    width = sh.sk if lo is None else max(1, int((hi - lo).max(initial=1)))
    unmasked = lo is None or (len(lo) > 0 and _unmasked(lo, hi, sh.sk))
    scores = CALL_SCORES if threaded and unmasked else SHORT_CALL_SCORES
    return max(16, scores // max(1, sh.b * sh.g * width))


def _tensors(torch, sh):
    """q (B, g, Sq, D) and k, v (B, 1, Sk, D) as tensors sharing the arrays' memory (contiguous k, v)."""
    if hasattr(sh, "k"):
        k, v = sh.k, sh.v
    else:  # [x | 1]^T blocks (``padded=True``): one contiguous copy each (the op is slow on transposed keys, §14)
        k, v = scratch("torch.k", (sh.b, sh.sk, sh.d), sh.dtype), scratch("torch.v", (sh.b, sh.sk, sh.dv), sh.dtype)
        np.copyto(k, np.swapaxes(sh.kt[:, :sh.d], -1, -2))  # in kept buffers (docs/performance.md §14)
        np.copyto(v, np.swapaxes(sh.vt[:, :sh.dv], -1, -2))
    return _tensor(torch, sh.q), _tensor(torch, k)[:, None], _tensor(torch, v)[:, None]


def _tensor(torch, x):
    """``x`` as a tensor sharing its memory: rows of a larger array (a zigzag half) as they are, strided (the ops
    take any stride but the last's; no copy per piece, docs/performance.md §22)."""
    if x.strides[-1] != x.itemsize or min(x.strides) < 0:
        x = np.ascontiguousarray(x)
    with warnings.catch_warnings():  # read-only inputs: the ops only read them
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(x)


def _additive(torch, mask, dtype):
    return torch.from_numpy(np.where(mask, 0.0, -np.inf).astype(dtype))


def forward(q, k, v, scale=None, klo=None, khi=None, *, padded=False, into=None, progress=None):
    """``kernels.attention_block``'s result for a block ``supports`` accepts: ``(out, lse)``, or merged ``into``."""
    torch = _torch()
    _threads(torch)
    sh = Shapes(q, k, v, padded)
    dt, b, g, sq, sk, dv = sh.dtype, sh.b, sh.g, sh.sq, sh.sk, sh.dv
    scale = default_scale(sh.d) if scale is None else float(scale)
    lo, hi = mask_arrays(klo, khi, sq, sk)
    if into is None:
        out, lse = np.zeros((b, g, sq, dv), dt), np.full((b, g, sq), -np.inf, dt)
    else:
        out, lse = as_view(into[0], (b, g, sq, dv)), as_view(into[1], (b, g, sq))
    tq, tk, tv = _tensors(torch, sh)
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    tick = Progress(progress)
    with torch.no_grad():
        for a, e, c, d, causal, mask, dead in _calls(lo, hi, sq, sk, _rows_per_call(sh, lo, hi, tick.threaded)):
            attn = None if mask is None else _additive(torch, mask, dt)
            o, s = tick.during(lambda: op(tq[:, :, a:e], tk[:, :, c:d], tv[:, :, c:d], 0.0, causal,  # noqa: B023
                                          attn_mask=attn, scale=scale))  # noqa: B023 - called at once
            o, s = o.numpy(), s.numpy()
            if dead is not None and dead.any():
                s[..., dead] = -np.inf
                o[..., dead, :] = 0
            if np.isneginf(lse[:, :, a:e]).all():  # nothing merged into these rows yet: the call's pair is theirs
                out[:, :, a:e], lse[:, :, a:e] = o, s
            else:
                merge(out[:, :, a:e], lse[:, :, a:e], o, s, inplace=True)
    trim_heap()  # the op's outputs, freed: see the module docstring
    if into is not None:
        return into
    return out.reshape(sh.lead + out.shape[-2:]), lse.reshape(sh.lead + lse.shape[-1:])


def backward(dout, q, k, v, out, lse, scale=None, klo=None, khi=None, *, progress=None, buffers=None):
    """``kernels.attention_block_backward``'s (dq, dk, dv) for a block ``supports`` accepts (with its lse)."""
    torch = _torch()
    _threads(torch)
    sh = Shapes(q, k, v)
    dt, b, g, sq, sk, d, dv = sh.dtype, sh.b, sh.g, sh.sq, sh.sk, sh.d, sh.dv
    scale = default_scale(d) if scale is None else float(scale)
    lo, hi = mask_arrays(klo, khi, sq, sk)
    shapes = ((b, g, sq, d), (b, sk, d), (b, sk, dv))
    if buffers is None:
        grads = tuple(np.empty(s, dt) for s in shapes)
    else:
        grads = tuple(as_view(x, s) for x, s in zip(buffers, shapes))
        if any(x.dtype != dt for x in grads):
            raise ValueError(f"buffers must be in the compute dtype {dt}")
    do4 = np.asarray(dout).reshape(b, g, sq, dv).astype(dt, copy=False)
    o4 = np.asarray(out).reshape(b, g, sq, dv).astype(dt, copy=False)
    l3 = np.asarray(lse).reshape(b, g, sq).astype(dt)  # a copy: rows that see no key get +inf (p = 0)
    dead = ~np.isfinite(l3)
    if dead.any():  # rows without any key anywhere: no gradient (the op would take exp(s + inf))
        l3[dead] = np.inf
        do4 = np.where(dead[..., None], 0, do4).astype(dt)
        o4 = np.where(dead[..., None], 0, o4).astype(dt)
    tq, tk, tv = _tensors(torch, sh)
    tdo, to, tl = (_tensor(torch, x) for x in (do4, o4, l3))
    dq, dk, dvv = grads
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    tick = Progress(progress)
    calls = list(_calls(lo, hi, sq, sk, _rows_per_call(sh, lo, hi, tick.threaded), TRIANGLE_ROWS))
    whole = len(calls) == 1 and calls[0][:4] == (0, sq, 0, sk)  # one call gives every gradient: written once
    if not whole:
        for x in grads:
            x.fill(0)
    with torch.no_grad():
        for a, e, c, d_, causal, mask, _ in calls:
            attn = None if mask is None else _additive(torch, mask, dt)
            gq, gk, gv = tick.during(lambda: op(tdo[:, :, a:e], tq[:, :, a:e], tk[:, :, c:d_],  # noqa: B023
                                                tv[:, :, c:d_], to[:, :, a:e], tl[:, :, a:e], 0.0,  # noqa: B023
                                                causal, attn_mask=attn, scale=scale))  # noqa: B023
            for total, part in ((dq[:, :, a:e], gq.numpy()), (dk[:, c:d_], gk.numpy()[:, 0]),
                                (dvv[:, c:d_], gv.numpy()[:, 0])):
                if whole:
                    np.copyto(total, part)
                else:
                    total += part
    trim_heap()
    return dq.reshape(sh.lead + dq.shape[-2:]), dk.reshape(sh.k_shape), dvv.reshape(sh.v_shape)
