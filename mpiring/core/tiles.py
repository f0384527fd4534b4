"""The tiles of the attention kernels: shapes, mask tiles, scratch buffers, progress calls. No MPI.

Shared by the forward and backward kernels (``mpiring.core.kernels``): how q, k, v
are viewed as (B, g, S, D) blocks, which (query tile, key tile) pairs a mask
leaves, and the per-thread scratch buffers kept between calls.
"""

import _thread
import functools
import sys
import threading
import time
import warnings
from dataclasses import dataclass, replace

import numpy as np

from .tuning.machine import cached_tiles  # the tuning cache, read once per process

__all__ = ["BlockRun", "PLAIN_RUN", "with_moved", "TILE_BYTES", "TILE_K", "PROGRESS_INTERVAL", "default_tiles",
           "default_scale", "kernel_dtype", "Shapes", "mask_arrays", "scratch", "filled", "release_workspace",
           "pad_ones", "transpose_into", "as_view", "with_ones", "max_abs", "tile_max_norm", "tile_max_norm_t", "Tiles",
           "Progress", "polls_from_a_thread", "stop_helper_polls"]

# Default tiles: 512 x 256 for float32, 256 x 256 for float64, i.e. the score tile of one head is
# 512 KiB (docs/performance.md §21). Larger query tiles make better GEMMs; larger key tiles spill the
# per-call scratch (H * tile_q * tile_k) from cache. ``python -m mpiring bench tune`` finds this CPU's.
TILE_BYTES = 512 * 1024
TILE_K = 256
# Seconds of compute between two calls of the progress callback.
PROGRESS_INTERVAL = 0.002


@dataclass(frozen=True)
class BlockRun:
    """How one block's forward or backward runs: its tiles (None: ``default_tiles``), ``progress`` (called between
    tiles, at most every PROGRESS_INTERVAL seconds) and, for a backward, ``rowsum``: whether delta is
    rowsum(dout * out), known for every row of the call (``core.block.queries``; None: the backend checks these
    rows)."""

    tile_q: int | None = None
    tile_k: int | None = None
    progress: object = None
    rowsum: bool | None = None


PLAIN_RUN = BlockRun()


def with_moved(run, moved, name):
    """``run`` with the keywords that moved into ``BlockRun`` (tile_q, tile_k, progress: a DeprecationWarning)."""
    unknown = sorted(set(moved) - {"tile_q", "tile_k", "progress"})
    if unknown:
        raise TypeError(f"{name}() got an unexpected keyword argument {unknown[0]!r}")
    if moved:
        warnings.warn(f"{name}({', '.join(f'{key}=' for key in moved)}) moved into "
                      f"run=mpiring.core.tiles.BlockRun(...)", DeprecationWarning, stacklevel=3)
    return replace(run, **moved) if moved else run


# Seconds between two polls of ``Progress.during``'s helper thread (each wakes it on the compute core).
THREAD_POLL_INTERVAL = 0.005


def default_tiles(d, dtype, kind="fwd"):
    """Default (tile_q, tile_k) of the ``kind`` ("fwd"/"bwd") kernel for head dim d and dtype.

    What ``python -m mpiring bench tune`` found fastest on this machine, when it was
    run; else the constants above (d did not matter there: 64 and 128).
    """
    return cached_tiles(kind, d, dtype) or (TILE_BYTES // (TILE_K * np.dtype(dtype).itemsize), TILE_K)


def default_scale(dim):
    """Softmax scale 1/sqrt(dim), as in torch SDPA."""
    return 1.0 / np.sqrt(dim)



def kernel_dtype(dtype):
    """The dtype the kernels compute in for inputs of ``dtype``: float32 and float64 are kept;
    float16 and bfloat16 compute in float32, ints in float64."""
    dtype = np.dtype(dtype)
    half = dtype.kind == "f" or dtype.name == "bfloat16"
    return np.result_type(dtype, np.float32) if half else np.dtype(np.float64)


class Shapes:
    """Views of q, k, v as (B, g, Sq, D), (B, Sk, D), (B, Sk, Dv), B = batch*Hk."""

    def __init__(self, q, k, v, padded=False):
        q, k, v = np.asarray(q), np.asarray(k), np.asarray(v)
        if padded:  # [k | 1]^T, [v | 1]^T (..., D+1, Sk): check and keep them, k, v as transposed views
            kp, vp = k, v
            k, v = np.swapaxes(k[..., :-1, :], -1, -2), np.swapaxes(v[..., :-1, :], -1, -2)
        if q.ndim != k.ndim or q.ndim != v.ndim or q.ndim < 2:
            raise ValueError("q, k, v must have the same ndim >= 2")
        self.lead, self.k_shape, self.v_shape = q.shape[:-2], k.shape, v.shape
        if q.ndim == 2:
            q, k, v = q[None], k[None], v[None]
        batch = q.shape[:-3]
        if k.shape[:-3] != batch or v.shape[:-3] != batch:
            raise ValueError("q, k, v batch dims differ")
        hq, self.sq, self.d = q.shape[-3:]
        hk, self.sk, dk = k.shape[-3:]
        if dk != self.d or v.shape[-3:-1] != (hk, self.sk):
            raise ValueError("shape mismatch: q %s k %s v %s" % (q.shape, k.shape, v.shape))
        if hq % hk:
            raise ValueError("Hq=%d is not a multiple of Hk=%d" % (hq, hk))
        self.g = hq // hk
        self.dv = v.shape[-1]
        self.b = int(np.prod(batch, dtype=np.int64)) * hk
        self.dtype = kernel_dtype(q.dtype)
        if q.dtype != self.dtype:  # widened once: a product with a Python float would stay in a half dtype
            q = q.astype(self.dtype)
        if not padded:  # half K/V beside widened queries (pass-Q's own block) too
            k, v = (x if x.dtype == self.dtype else x.astype(self.dtype) for x in (k, v))
        self.q = q.reshape(self.b, self.g, self.sq, self.d)
        if padded:  # no copies: views of the caller's blocks (B, D+1, Sk)
            self.kt, self.vt = as_view(kp, (self.b, self.d + 1, self.sk)), as_view(vp, (self.b, self.dv + 1, self.sk))
        else:
            self.k = k.reshape(self.b, self.sk, self.d)
            self.v = v.reshape(self.b, self.sk, self.dv)


def mask_arrays(klo, khi, sq, sk):
    """int64 klo, khi of shape (sq,), or (None, None) when all keys are visible."""
    if klo is None and khi is None:
        return None, None
    lo = np.zeros(sq, np.int64) if klo is None else np.asarray(klo, np.int64).reshape(sq)
    hi = np.full(sq, sk, np.int64) if khi is None else np.asarray(khi, np.int64).reshape(sq)
    return np.clip(lo, 0, sk), np.clip(hi, 0, sk)


# Scratch buffers are kept between calls (per thread): the ring calls the
# kernels P times with the same shapes, and fresh multi-MiB buffers cost page
# faults (docs/performance.md §11).  Results are always new arrays.
_workspace = threading.local()


def scratch(name, shape, dtype):
    """A scratch array of this shape, reusing this thread's buffer `name` when big enough."""
    n = int(np.prod(shape, dtype=np.int64))
    bufs = _workspace.__dict__.setdefault("bufs", {})
    buf = bufs.get((name, dtype))
    if buf is None or buf.size < n:
        buf = bufs[(name, dtype)] = np.empty(n, dtype)
    return buf[:n].reshape(shape)


def filled(name, shape, dtype, value):
    """``scratch(name, shape, dtype)`` set to ``value``: a kept buffer rather than fresh memory.

    For the ring's accumulators and receive slots (tens of MiB per call): fresh
    memory is paid for in page faults at its first touch (docs/performance.md §11), a kept buffer
    only in the fill.
    Whoever returns such a buffer's contents returns a copy. ``name`` None: a
    new array instead (``np.zeros`` for 0: its pages are mapped as they are written).
    """
    if name is None:
        return np.zeros(shape, dtype) if value == 0 else np.full(shape, value, dtype)
    out = scratch(name, shape, dtype)
    out.fill(value)
    return out


def release_workspace():
    """Free the buffers this thread keeps between calls: the kernels' scratch and the ring's kept buffers.

    A ring call keeps its accumulators and receive slots for the next call
    (``filled``), as PyTorch's caching allocator keeps freed blocks: about
    the size of the forward's running output in float64 and four K/V blocks,
    and for the backward its gradient sums (half inputs'), the partials' and K/V slots and a
    block's gradients (docs/performance.md §11). Calls after this allocate anew.
    """
    _workspace.__dict__.pop("bufs", None)


def pad_ones(x, out=None):
    """x (..., S, D) as [x | 1]^T, shape (..., D+1, S): the ``padded`` form of k and v.

    Transposed, with a last row of ones. With ``out`` (an array of that
    shape), fills it instead of allocating.
    """
    x = np.asarray(x)
    if out is None:
        out = np.empty(x.shape[:-2] + (x.shape[-1] + 1, x.shape[-2]), x.dtype)
    transpose_into(x, out[..., :-1, :])
    out[..., -1, :] = 1
    return out


TRANSPOSE_KEYS = 64  # tokens per piece of ``transpose_into``


def transpose_into(x, out):
    """``out[...] = x`` with its last two axes swapped, ``TRANSPOSE_KEYS`` tokens at a time.

    A piece's rows and columns stay in cache while it is written, faster than one strided copy
    (docs/performance.md §21).
    """
    for c in range(0, x.shape[-2], TRANSPOSE_KEYS):
        out[..., c:c + TRANSPOSE_KEYS] = np.swapaxes(x[..., c:c + TRANSPOSE_KEYS, :], -1, -2)


def as_view(x, shape):
    """x reshaped without a copy (raises if impossible): results written to it must land in x."""
    y = x.view()
    y.shape = shape
    return y


def with_ones(x, dtype, name):
    """Copy of x (B, S, D) as (B, S, D+1) with a last column of ones (a scratch buffer)."""
    out = scratch(name, x.shape[:-1] + (x.shape[-1] + 1,), dtype)
    out[..., :-1] = x
    out[..., -1] = 1
    return out


def tile_max_norm_t(xt, tile):
    """``tile_max_norm`` of x given as xt = x^T (B, D, S): row by row of xt, each pass contiguous."""
    n2 = np.zeros(xt.shape[::2], np.float64)
    for row in np.moveaxis(xt, 1, 0):
        n2 += np.square(row, dtype=np.float64)
    n = np.sqrt(n2).max(axis=0)
    return np.maximum.reduceat(n, np.arange(0, n.size, tile))


def max_abs(x):
    """Largest |entry| of x as a float, in two passes without a temporary: nan if x has a nan (np.min and np.max
    both give it), inf if it has an infinity, 0 if x is empty."""
    return max(-float(np.min(x)), float(np.max(x))) if x.size else 0.0


def tile_max_norm(x, tile):
    """Max row norm of x (..., S, D) over each tile of rows: shape (ceil(S/tile),)."""
    n = np.sqrt(np.einsum("...i,...i->...", x, x, dtype=np.float64))
    n = n.reshape(-1, n.shape[-1]).max(axis=0)
    return np.maximum.reduceat(n, np.arange(0, n.size, tile))


class Tiles:
    """Classifies (query tile, key tile) pairs of a klo/khi mask and caches mask tiles."""

    def __init__(self, lo, hi, sk, tile_k, dtype):
        self.lo, self.hi, self.sk, self.tk, self.dtype = lo, hi, sk, tile_k, dtype
        self._cache = {}
        self.examined = 0  # key tiles looked at by row_block (masked case): only those some row sees

    def row_block(self, a, b):
        """Start work on query rows a:b; returns a list of key tiles (c, d, r0, r1, mask, t).

        Keys c:d of key tile t are seen by some of the rows a+r0 : a+r1;
        mask is None when all those rows see all those keys, else the float
        0/1 mask (r1-r0, d-c).  Empty tiles are left out; partial tiles are
        trimmed to the rows and columns that see something.
        """
        n = b - a
        if self.lo is None:
            return [(c, min(c + self.tk, self.sk), 0, n, None, t) for t, c in enumerate(range(0, self.sk, self.tk))]
        seen = self.hi[a:b] > self.lo[a:b]
        if not seen.any():
            return []
        # only the key tiles that some row sees: a window never visits the (many) tiles outside it
        first = int(self.lo[a:b][seen].min()) // self.tk
        last = (int(self.hi[a:b][seen].max()) - 1) // self.tk
        tiles = []
        self.examined += last + 1 - first
        for t in range(first, last + 1):
            c = t * self.tk
            d = min(c + self.tk, self.sk)
            lo, hi = np.maximum(self.lo[a:b], c), np.minimum(self.hi[a:b], d)
            seen = np.flatnonzero(hi > lo)
            if seen.size == 0:
                continue                          # no row sees any key here
            r0, r1 = int(seen[0]), int(seen[-1]) + 1
            lo, hi = lo[r0:r1], hi[r0:r1]
            c, d = int(lo[hi > lo].min()), int(hi.max())
            if lo.max() <= c and hi.min() >= d:
                tiles.append((c, d, r0, r1, None, t))   # all rows see all keys
            else:
                tiles.append((c, d, r0, r1, self._mask(lo - c, hi - c, d - c), t))
        return tiles

    def _mask(self, lo, hi, n):
        key = (lo.tobytes(), hi.tobytes(), n)
        m = self._cache.get(key)
        if m is None:
            cols = np.arange(n)
            m = ((cols >= lo[:, None]) & (cols < hi[:, None])).astype(self.dtype)
            if len(self._cache) < 64:
                self._cache[key] = m
        return m


_HELPERS_POLLING = threading.Lock()  # held by a helper thread (Progress.during) while it calls MPI
_HELPERS_STOPPED = threading.Event()


def stop_helper_polls():
    """After this returns, no helper thread of ``Progress.during`` calls MPI again in this process.

    For a SIGINT handler that finalizes MPI while the interrupted thread waits for its helper: a poll
    after MPI_Finalize would end the process with MPI's own error instead of the handler's exit code.
    """
    with _HELPERS_POLLING:
        _HELPERS_STOPPED.set()


def polls_from_a_thread():
    """Whether a progress callback may run in a helper thread while this one computes.

    It may unless MPI is initialized at a thread level below MPI_THREAD_SERIALIZED (the
    helper calls MPI only while this thread is inside a call that makes none).
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return True
    return mpi.Query_thread() >= mpi.THREAD_SERIALIZED


class Progress:
    """Calls fn() at most every PROGRESS_INTERVAL seconds; ``during`` calls it while a long call runs."""

    def __init__(self, fn):
        self.fn = fn
        self.last = time.perf_counter()

    @functools.cached_property
    def threaded(self):
        """Whether ``during`` polls from a helper thread (asked only by kernels that call ``during``)."""
        return self.fn is not None and polls_from_a_thread()

    def __call__(self):
        if self.fn is not None:
            now = time.perf_counter()
            if now - self.last >= PROGRESS_INTERVAL:
                self.fn()
                self.last = time.perf_counter()

    def during(self, call):
        """``call()``, with fn() polled every THREAD_POLL_INTERVAL seconds meanwhile by a helper thread.

        For calls that release the GIL (a torch op): MPI moves a rank's messages
        while its one core computes, however long the call. An error fn raised
        is raised here after the call. Without ``threaded``, fn() runs after it.
        """
        if not self.threaded:
            result = call()
            self()
            return result
        done, errors = threading.Event(), []

        def poll():
            while not done.wait(THREAD_POLL_INTERVAL):
                with _HELPERS_POLLING:
                    if done.is_set() or _HELPERS_STOPPED.is_set():
                        return
                    try:
                        self.fn()
                    except BaseException as exc:  # noqa: BLE001 - raised in the calling thread below
                        errors.append(exc)
                        return

        # Neither waited for to start nor joined (threading.Thread's start waits until the new thread runs:
        # 0.3 ms a call while the other rank holds the other core, docs/performance.md §24). Once ``done`` is
        # set and the lock taken, the helper is not in fn() and never enters it again.
        _thread.start_new_thread(poll, ())
        try:
            result = call()
        finally:
            done.set()
            with _HELPERS_POLLING:
                pass
        if errors:
            raise errors[0]
        self()
        return result


