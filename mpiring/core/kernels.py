"""Attention kernels for mpiring: tiled FlashAttention-2 forward/backward in NumPy.

Layout follows torch SDPA: q (..., Hq, Sq, D), k (..., Hk, Sk, D),
v (..., Hk, Sk, Dv); 2-D (S, D) inputs also work.  Grouped-query attention:
Hq = g * Hk and query head h uses key/value head h // g.

A mask is two int arrays klo, khi of shape (Sq,): query row i sees exactly the keys j with
klo[i] <= j < khi[i] (clipped to [0, Sk]), the same for every head and batch entry.  None
means "all keys visible".  Causal square: klo = 0, khi = i + 1.

How the tiled forward pass works (per query tile, per key tile):

    s = (scale * log2 e) * q @ k.T - m     # one GEMM, m folded in (see below)
    p = exp2(s)                            # the only full-tile elementwise pass
    [acc | l] += p @ [v | 1]               # one GEMM gives p@v and the row sums

The forward kernel keeps k and v transposed, with a row of ones appended:
[k | 1]^T of shape (D+1, Sk) per head ("padded", made by ``pad_ones``).
The ring's receive buffers hold blocks in this form, so a block needs no
copy, and its data (D*Sk values per head) travels as one contiguous piece.

The row offset m is *not* the running maximum.  It starts as the score of the
row's first visible key, so every row sum is >= 1 (no underflow to 0); it is
only raised (the "slow path", an exact online-softmax step) when a tile's row
sum would exceed 2**64 (fp32) / 2**512 (fp64).  With m folded into the GEMM as
an extra column of q (and a column of ones in k), the usual max/subtract passes
disappear.  Mathematically this is exactly the softmax; only rounding differs.
"""

import math

import numpy as np

from .tiles import (
    PLAIN_RUN,
    BlockRun,
    Progress,
    Shapes,
    Tiles,
    as_view,
    default_scale,
    default_tiles,
    mask_arrays,
    pad_ones,
    scratch,
    tile_max_norm,
    tile_max_norm_t,
    with_ones,
)
from .tuning import gemm

__all__ = ["attention_block", "attention_block_backward", "merge", "merge_weight", "merge_commutative",
           "default_scale", "pad_ones", "LSE_LIMIT", "EXACT_ABOVE", "empty_or_nan"]

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)

# A tile row sum above this triggers the exact (rescaling) path: accumulators far from overflow (log2 units).
_LIMIT_LOG2 = {np.dtype(np.float32): 64.0, np.dtype(np.float64): 512.0}
# Above this bound on |scores| (log2 units, max row norms of q and k) the rounding of a
# score computed in the input dtype, with the offset folded into the GEMM, can reach one
# unit of log2: such tiles take the exact float64 path (``_exact_rows``, ``_exact_probs``).
# About (D+1) eps |q||k| is the error bound; 1/(256 eps) leaves room for D up to 255.
EXACT_ABOVE = {np.dtype(np.float32): 1 / (256 * 2.0 ** -23), np.dtype(np.float64): 1 / (256 * 2.0 ** -52)}
# |lse| above which exp(s - lse), recomputed in the backward pass, is off by more than ~0.1 %
# from the rounding of lse alone (2**-10 / eps): such gradients are refused, not returned wrong.
LSE_LIMIT = {np.dtype(np.float32): 2.0 ** 13, np.dtype(np.float64): 2.0 ** 42}
# exp2 below this is subnormal/zero and very slow; such scores are clipped up
# to it (adds < Sk * 2**-126 relative to a row sum >= 1: far below rounding).
_FLOOR_LOG2 = {np.dtype(np.float32): -126.0, np.dtype(np.float64): -1022.0}


# ---------------------------------------------------------------- forward

def attention_block(
    q: np.ndarray,  # (..., Hq, Sq, D)
    k: np.ndarray,  # (..., Hk, Sk, D), or (..., Hk, D+1, Sk) when padded
    v: np.ndarray,  # (..., Hk, Sk, Dv), or (..., Hk, Dv+1, Sk) when padded
    scale: float | None = None, klo: np.ndarray | None = None, khi: np.ndarray | None = None,  # (Sq,) each
    *, padded: bool = False, into=None, run: BlockRun = PLAIN_RUN,
) -> tuple[np.ndarray, np.ndarray]:  # out (..., Hq, Sq, Dv), lse (..., Hq, Sq)
    """Softmax attention of q over one key block: returns (out, lse).

    out (..., Hq, Sq, Dv) is the normalized output, lse (..., Hq, Sq) the
    natural log of the row sums of exp(scale * q.k) over visible keys
    (-inf, with out 0, for a row that sees no key).  Tiled with an online
    softmax: scratch is O(batch * Hq * tile_q * tile_k), plus one copy of k
    and v with an extra column of ones unless ``padded``; never O(Sq * Sk).

    Args:
        q, k, v: (..., Hq, Sq, D), (..., Hk, Sk, D), (..., Hk, Sk, Dv), or 2-D.
        scale: logit scale, default 1/sqrt(D).
        klo, khi: int (Sq,) arrays; row i sees keys klo[i] <= j < khi[i].
        padded: k and v are given as ``pad_ones(k)``, ``pad_ones(v)``:
            transposed with a row of ones, (..., Hk, D+1, Sk) and
            (..., Hk, Dv+1, Sk), as the ring keeps its K/V blocks; then no
            copy of k and v is made.
        into: running ``(out, lse)`` of the same query rows from other key
            blocks (e.g. float64 accumulators).  Each finished query tile is
            merged into them in place with ``merge`` (the log-sum-exp rule),
            so the block's own output is never materialized; returns them.
        run: its tiles (default: default_tiles(D, dtype)) and ``progress``, a
            zero-argument callable called between tiles, at most every
            PROGRESS_INTERVAL seconds (e.g. to poll MPI requests): ``tiles.BlockRun``.
    """
    sh = Shapes(q, k, v, padded)
    dt, b, g, sq, sk, d, dv = sh.dtype, sh.b, sh.g, sh.sq, sh.sk, sh.d, sh.dv
    dq_tile, dk_tile = default_tiles(d, dt)
    tq, tk = run.tile_q or dq_tile, run.tile_k or dk_tile
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    c2 = scale * LOG2E                        # scores in log2 units: exp2 is cheaper than exp
    limit_log2 = _LIMIT_LOG2[dt]
    limit = 2.0 ** limit_log2
    mm = gemm.product()
    floor = _FLOOR_LOG2[dt]
    lo, hi = mask_arrays(klo, khi, sq, sk)
    tiles = Tiles(lo, hi, sk, tk, dt)
    tick = Progress(run.progress)

    if into is None:
        out = np.empty((b, g, sq, dv), dt)
        lse = np.empty((b, g, sq), dt)
    else:
        out, lse = as_view(into[0], (b, g, sq, dv)), as_view(into[1], (b, g, sq))
    if sk == 0 or sq == 0:
        if into is None:
            out.fill(0)
            lse.fill(-np.inf)
        return _unflatten(out, lse, sh) if into is None else into

    if padded:                                # [k | 1]^T and [v | 1]^T as given
        kt, vt = sh.kt, sh.vt
    else:                                     # one transposed copy each, in scratch
        kt = pad_ones(sh.k, scratch("kt", (b, d + 1, sk), dt))
        vt = pad_ones(sh.v, scratch("vt", (b, dv + 1, sk), dt))
    # kt's row of ones meets -m in q's extra column; p @ vt.T also gives the row sums
    kn = tile_max_norm_t(kt[:, :d], tk)     # for the cheap "can exp2 underflow?" test
    qn = tile_max_norm(sh.q, tq) * abs(c2)
    exact = ~(qn * kn.max() <= EXACT_ABOVE[dt])   # query tiles whose scores are too large (or inf/NaN)
    sees = None if lo is None else hi > lo    # rows that see at least one key of this block

    nq = min(tq, sq)
    qa_buf = scratch("qa", b * g * nq * (d + 1), dt)
    s_buf = scratch("s", b * g * nq * min(tk, sk), dt)
    pv_buf = scratch("pv", b * g * nq * (dv + 1), dt)
    acc_buf = scratch("acc", b * g * nq * (dv + 1), dt)
    if into is not None:                      # this block's output of one query tile
        tile_out_buf = scratch("tile_out", b * g * nq * dv, dt)
        tile_lse_buf = scratch("tile_lse", b * g * nq, dt)

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for it, a in enumerate(range(0, sq, tq)):
            e = min(a + tq, sq)
            rows = g * (e - a)
            qa = qa_buf[:b * rows * (d + 1)].reshape(b, g, e - a, d + 1)
            np.multiply(sh.q[:, :, a:e], c2, out=qa[..., :d])
            # Offset m = score of each row's first visible key (any visible key
            # works: it makes every row sum >= 1).
            first = np.zeros(e - a, np.int64) if lo is None else np.minimum(lo[a:e], sk - 1)
            if first.min() == first.max():    # one key for all rows (full, causal): a matrix-vector product
                m = np.matmul(qa[..., :d], kt[:, None, :d, first[0]:first[0] + 1])[..., 0]
            else:
                m = np.einsum("bgtd,bdt->bgt", qa[..., :d], kt[:, :d, first])
            qa[..., d] = -m
            m_top, m_low = m.max(), m.min()
            acc = acc_buf[:b * rows * (dv + 1)].reshape(b, g, e - a, dv + 1)
            acc.fill(0)
            for c, dd, r0, r1, mask, t in [] if exact[it] else tiles.row_block(a, e):
                n, cols = r1 - r0, dd - c
                qt = qa[:, :, r0:r1].reshape(b, g * n, d + 1)   # a copy only if g > 1 and rows trimmed
                s = s_buf[:b * g * n * cols].reshape(b, g * n, cols)
                mm(qt, kt[:, :, c:dd], s)
                s4 = s.reshape(b, g, n, cols)
                if mask is not None:
                    s4 *= mask                    # masked scores -> 0: no overflow
                if -qn[it] * kn[t] - m_top < floor:
                    np.clip(s, floor, None, out=s)
                np.exp2(s, out=s)
                if mask is not None:
                    s4 *= mask                    # masked probabilities -> exactly 0
                vtt = vt[:, :, c:dd].transpose(0, 2, 1)
                into_acc = _rows_view(acc, r0, r1)
                if into_acc is not None and qn[it] * kn[t] - m_low + math.log2(cols) <= limit_log2:
                    mm(s, vtt, into_acc, beta=1.0)    # row sums provably below the limit: add in place
                    tick()
                    continue
                pv = pv_buf[:b * g * n * (dv + 1)].reshape(b, g * n, dv + 1)
                mm(s, vtt, pv)
                if pv[..., dv].max() <= limit:
                    acc[:, :, r0:r1] += pv.reshape(b, g, n, dv + 1)
                else:                             # rare: some score far above m
                    _exact_tile(qt, kt[:, :, c:dd], vt[:, :, c:dd], mask, s4, pv,
                                acc[:, :, r0:r1], m[:, :, r0:r1])
                    qa[..., d] = -m
                    m_top, m_low = m.max(), m.min()
                tick()
            rowsum = acc[..., dv]
            ok = rowsum > 0
            if into is None:
                tile_out, tile_lse = out[:, :, a:e], lse[:, :, a:e]
            else:
                tile_out = tile_out_buf[:b * rows * dv].reshape(b, g, e - a, dv)
                tile_lse = tile_lse_buf[:b * rows].reshape(b, g, e - a)
            np.divide(acc[..., :dv], np.where(ok, rowsum, 1)[..., None], out=tile_out)
            tile_lse[...] = np.where(ok, (m + np.log2(rowsum)) * LN2, empty_or_nan(rowsum))
            # A row sum is >= 1 in exact arithmetic (the offset is one of the row's scores, or
            # its max). Below 1/2, or not finite, rounding beat the fast path: redo those rows.
            # (a NaN or Inf in v's columns needs no redo: it is the IEEE answer, kept as it is)
            redo = ~(rowsum >= 0.5) if not exact[it] else np.ones(rowsum.shape, bool)
            if sees is not None:
                redo &= sees[a:e]
            if redo.any():
                idx = np.flatnonzero(redo.any(axis=(0, 1)))
                ex_out, ex_lse = _exact_rows(sh.q[:, :, a:e][:, :, idx], kt, vt, scale,
                                             None if lo is None else lo[a:e][idx],
                                             None if hi is None else hi[a:e][idx])
                pick = redo[:, :, idx]
                tile_out[:, :, idx] = np.where(pick[..., None], ex_out, tile_out[:, :, idx])
                tile_lse[:, :, idx] = np.where(pick, ex_lse, tile_lse[:, :, idx])
            if into is not None:
                merge(out[:, :, a:e], lse[:, :, a:e], tile_out, tile_lse, inplace=True)
    return _unflatten(out, lse, sh) if into is None else into


def _rows_view(acc, r0, r1):
    """Rows r0:r1 of acc (b, g, n, w) as a (b, g * (r1 - r0), w) view, or None when that needs a copy."""
    b, g, n, w = acc.shape
    if g > 1 and (r0, r1) != (0, n):
        return None
    return as_view(acc[:, :, r0:r1], (b, g * (r1 - r0), w))


def _exact_tile(qt, ktt, vtt, mask, s4, pv, acc, m):
    """Exact online-softmax step for one tile: raise m where needed, rescale acc.

    Used only when a tile's row sum passed the limit.  ktt, vtt are the
    tile's [k | 1]^T, [v | 1]^T; s4 (b, g, n, cols) and pv are scratch;
    acc (b, g, n, dv+1) and m (b, g, n) are updated in place.
    """
    b, g, n, cols = s4.shape
    s = s4.reshape(b, g * n, cols)
    np.matmul(qt, ktt, out=s)
    if mask is not None:
        s4[np.broadcast_to(mask == 0, s4.shape)] = -np.inf
    inc = np.maximum(s4.max(axis=-1), 0)      # how far each row max exceeds m
    s4 -= inc[..., None]
    np.exp2(s, out=s)
    np.matmul(s, vtt.transpose(0, 2, 1), out=pv)
    acc *= np.exp2(-inc)[..., None]
    acc += pv.reshape(acc.shape)
    m += inc


def _exact_rows(q, kt, vt, scale, lo=None, hi=None):
    """Attention of query rows ``q`` (b, g, n, d) in float64 with the true row max: ``(out, lse)``.

    The slow path that is right for any finite logits: scores in float64, the
    row max subtracted exactly, as the textbook softmax. ``kt``, ``vt`` are the
    kernel's [k | 1]^T, [v | 1]^T (b, d+1, sk); rows see keys lo <= j < hi.
    Raises FloatingPointError if finite inputs give logits beyond float64;
    NaN or Inf inputs give NaN or Inf rows, never finite ones.
    """
    b, g, n, d = q.shape
    dv, sk = vt.shape[1] - 1, kt.shape[-1]
    k64 = kt[:, None, :d].astype(np.float64)
    v64 = np.swapaxes(vt[:, None, :dv], -1, -2).astype(np.float64)
    out, lse = np.zeros((b, g, n, dv)), np.full((b, g, n), -np.inf)
    step = max(1, (1 << 22) // max(1, b * g * sk))   # rows per chunk: scores of at most 4M entries
    with np.errstate(over="ignore", invalid="ignore"):
        for r0 in range(0, n, step):
            r1 = min(r0 + step, n)
            s = np.matmul(q[:, :, r0:r1].astype(np.float64), k64) * scale
            if lo is not None:
                cols = np.arange(sk)
                s = np.where((cols >= lo[r0:r1, None]) & (cols < hi[r0:r1, None]), s, -np.inf)
            m = s.max(axis=-1, keepdims=True)
            if (np.any(m == np.inf) or np.isnan(m).any()) and np.isfinite(q[:, :, r0:r1]).all() \
                    and np.isfinite(k64).all():  # finite inputs, infinite logits: no float can hold them
                raise FloatingPointError("attention logits overflow float64: scale * q.k is beyond "
                                         f"{np.finfo(np.float64).max:.3g}; rescale q, k or the softmax scale")
            # non-finite inputs: NaN and Inf run through as IEEE arithmetic (and torch SDPA) has them
            p = np.exp(s - np.where(np.isfinite(m), m, 0))
            den = p.sum(axis=-1)
            out[:, :, r0:r1] = np.matmul(p, v64) / np.where(den > 0, den, 1)[..., None]
            lse[:, :, r0:r1] = np.where(den > 0, m[..., 0] + np.log(np.where(den > 0, den, 1)), empty_or_nan(den))
    return out, lse


def empty_or_nan(total):
    """The lse of rows whose sum of weights ``total`` is not positive: -inf (no key seen), or NaN where the sum
    is NaN (a NaN score): a row whose out is NaN has a NaN lse too, never -inf, which the merge would drop."""
    return np.where(np.isnan(total), np.nan, -np.inf)



def _unflatten(out, lse, sh):
    """Reshape (B, g, Sq, Dv) / (B, g, Sq) results back to q's leading dims."""
    return out.reshape(sh.lead + out.shape[-2:]), lse.reshape(sh.lead + lse.shape[-1:])


# ---------------------------------------------------------------- merge

MERGE_ROWS = 256  # rows per slice of an in-place merge: 4096 rows x 8 heads merged 1.6x faster than at once (§23)


def merge(out: np.ndarray, lse: np.ndarray, block_out: np.ndarray | None, block_lse: np.ndarray, *,
          inplace: bool = False) -> tuple[np.ndarray, np.ndarray]:  # (..., S, Dv), (..., S)
    """Combine two normalized attentions over disjoint key sets (the log-sum-exp rule): the one merge.

    out (..., S, Dv), lse (..., S). NaN-free when either or both lse are -inf. Returns the merged ``(out, lse)``:
    new arrays, or ``out`` and ``lse`` overwritten when ``inplace``. ``block_out`` None: a block of zeros (a
    sink, ``scores.with_sinks``): out * exp(lse - new lse) (``merge_weight``), as out + (0 - out) * w cancels.
    """
    # naive: new_lse = log(exp(lse) + exp(block_lse)), out = (exp(lse) out + exp(block_lse) block_out) / exp(new_lse)
    # stable: weight of block_out = exp(block_lse - new_lse) = sigmoid(block_lse - lse)
    if block_out is None:
        new_lse, kept = merge_weight(lse, block_lse)
        return out * kept[..., None], new_lse
    new_lse = np.logaddexp(lse, block_lse)
    w = np.exp(block_lse - np.where(np.isneginf(new_lse), 0, new_lse))[..., None]
    if not inplace:
        return out + np.subtract(block_out, out) * w, new_lse
    for at in (np.s_[..., r:r + MERGE_ROWS, :] for r in range(0, out.shape[-2], MERGE_ROWS)):  # temporaries in cache
        step = np.subtract(block_out[at], out[at])
        out[at] += np.multiply(step, w[at], out=step)
    lse[...] = new_lse
    return out, lse


def merge_weight(lse, block_lse, xp=np):
    """``merge``'s ``(new lse, weight of out)``, exp(lse - new lse), in ``xp``'s ops (torch: trainable sinks)."""
    new_lse = xp.logaddexp(lse, block_lse)
    return new_lse, xp.exp(lse - xp.where(xp.isneginf(new_lse), 0, new_lse))


def merge_commutative(out: np.ndarray, lse: np.ndarray, other_out: np.ndarray, other_lse: np.ndarray,
                      into: tuple[np.ndarray, np.ndarray]) -> None:
    """``merge``'s rule max-then-sum, into ``into`` (either side): m = max(l1, l2), w_i = exp(l_i - m), out = (w1 o1 +
    w2 o2) / (w1 + w2), lse = m + log(w1 + w2); commutative to the bit (MPI's reduction order: ``decode.lse_merge``)."""
    m = np.maximum(lse, other_lse)
    m0 = np.where(np.isneginf(m), 0.0, m)
    wa, wb = np.exp(lse - m0), np.exp(other_lse - m0)
    total = wa + wb
    safe = np.where(total > 0, total, 1.0)
    into[0][...] = (wa[..., None] * out + wb[..., None] * other_out) / safe[..., None]
    with np.errstate(divide="ignore"):
        into[1][...] = np.where(total > 0, m0 + np.log(safe), empty_or_nan(total))


# ---------------------------------------------------------------- backward

def attention_block_backward(
    dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,  # (..., Hq, Sq, Dv), as attention_block
    out: np.ndarray, lse: np.ndarray,  # the final (merged) out (..., Hq, Sq, Dv) and lse (..., Hq, Sq)
    scale: float | None = None, klo: np.ndarray | None = None, khi: np.ndarray | None = None, *,
    delta: np.ndarray | None = None, buffers: tuple | None = None, run: BlockRun = PLAIN_RUN,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # dq, dk, dv: the shapes of q, k, v
    """FlashAttention-2 backward of one key block: returns (dq, dk, dv).

    out and lse must be the FINAL (merged over all key blocks) results, so the
    gradients of different key blocks just add up.  dk, dv are summed over
    the g query heads of a GQA group; masked pairs and rows with lse = -inf
    contribute exactly 0.  Accumulation is in the input dtype (float32 stays
    float32: relative error ~1e-7..1e-6 against float64 at S ~ 1e3).

    Args:
        dout: (..., Hq, Sq, Dv) gradient of the loss w.r.t. out.
        q, k, v, scale, klo, khi: as attention_block; run: its tiles and progress (``tiles.BlockRun``).
        out, lse: final attention output and log-sum-exp.
        delta: optional precomputed rowsum(dout * out), shape of lse.
        buffers: optional (dq, dk, dv) arrays, shaped as q, k, v in the compute dtype
            (``tiles.kernel_dtype``), to write the gradients into (overwritten);
            then those are returned, else new arrays.
    """
    sh = Shapes(q, k, v)
    dt, b, g, sq, sk, d, dv = sh.dtype, sh.b, sh.g, sh.sq, sh.sk, sh.d, sh.dv
    dq_tile, dk_tile = default_tiles(d, dt, "bwd")
    tq, tk = run.tile_q or dq_tile, run.tile_k or dk_tile
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    c2 = scale * LOG2E
    floor = _FLOOR_LOG2[dt]
    mm = gemm.product()
    lo, hi = mask_arrays(klo, khi, sq, sk)
    tiles = Tiles(lo, hi, sk, tk, dt)
    tick = Progress(run.progress)

    do4 = np.asarray(dout).reshape(b, g, sq, dv)
    lse3 = np.asarray(lse).reshape(b, g, sq)
    if delta is None:
        delta3 = np.einsum("bgsd,bgsd->bgs", do4, np.asarray(out).reshape(b, g, sq, dv))
    else:
        delta3 = np.asarray(delta).reshape(b, g, sq)
    peak = float(np.max(np.abs(lse3), initial=0, where=np.isfinite(lse3)))
    if peak > LSE_LIMIT[dt]:
        raise FloatingPointError(f"|lse| reaches {peak:.3g}, beyond {LSE_LIMIT[dt]:g} for {dt}: the recomputed "
                                 "probabilities exp(scale q.k - lse) would be wrong; rescale q, k or the scale")
    if buffers is None:
        dq, dk, dvv = np.zeros((b, g, sq, d), dt), np.zeros((b, sk, d), dt), np.zeros((b, sk, dv), dt)
    else:  # dk, dv are added into; dq is written tile by tile below
        dq, dk, dvv = (as_view(a, shape) for a, shape in zip(buffers, ((b, g, sq, d), (b, sk, d), (b, sk, dv))))
        if dq.dtype != dt or dk.dtype != dt or dvv.dtype != dt:
            raise ValueError(f"buffers must be in the compute dtype {dt}")
        dk.fill(0)
        dvv.fill(0)
    if sk == 0 or sq == 0:
        dq.fill(0)
        return _unflatten_grads(dq, dk, dvv, sh)

    ka = with_ones(sh.k, dt, "ka")           # [k | 1] meets -lse
    va = with_ones(sh.v, dt, "va")           # [v | 1] meets -delta
    kn = tile_max_norm(sh.k, tk)
    qn = tile_max_norm(sh.q, tq) * abs(c2)

    nq = min(tq, sq)
    nk = min(tk, sk)
    qa_buf = scratch("qa", b * g * nq * (d + 1), dt)
    doa_buf = scratch("doa", b * g * nq * (dv + 1), dt)
    p_buf = scratch("s", b * g * nq * nk, dt)
    dp_buf = scratch("dp", b * g * nq * nk, dt)
    dqt_buf = scratch("pv", b * g * nq * d, dt)
    dqa_buf = scratch("acc", b * g * nq * d, dt)

    with np.errstate(over="ignore", invalid="ignore"):
        for it, a in enumerate(range(0, sq, tq)):
            e = min(a + tq, sq)
            rows = g * (e - a)
            # qa = [c2*q | -lse*log2e], doa = [dout | -delta]; dead rows (lse=-inf) = 0.
            qa = qa_buf[:b * rows * (d + 1)].reshape(b, g, e - a, d + 1)
            doa = doa_buf[:b * rows * (dv + 1)].reshape(b, g, e - a, dv + 1)
            np.multiply(sh.q[:, :, a:e], c2, out=qa[..., :d])
            np.copyto(doa[..., :dv], do4[:, :, a:e])
            np.multiply(lse3[:, :, a:e], -LOG2E, out=qa[..., d])
            # not np.negative: NumPy 2.3-2.4's negative loop reads some strided views wrongly
            # (a one-row view of delta gave wrong dQ, dK with few tokens per rank)
            np.multiply(delta3[:, :, a:e], -1.0, out=doa[..., dv])
            dead = ~np.isfinite(lse3[:, :, a:e])
            if dead.any():
                qa[dead] = 0
                doa[dead] = 0
            top = -qa[..., d].min()
            dq_acc = dqa_buf[:b * rows * d].reshape(b, g, e - a, d)
            dq_acc.fill(0)
            for c, dd, r0, r1, mask, t in tiles.row_block(a, e):
                n, cols = r1 - r0, dd - c
                qt = qa[:, :, r0:r1].reshape(b, g * n, d + 1)    # copies only if g > 1 and
                dot = doa[:, :, r0:r1].reshape(b, g * n, dv + 1)  # rows were trimmed
                p = p_buf[:b * g * n * cols].reshape(b, g * n, cols)
                dp = dp_buf[:b * g * n * cols].reshape(b, g * n, cols)
                # p = exp2(c2 q.k - lse*log2e): probabilities from the final lse
                p4 = p.reshape(b, g, n, cols)
                if not qn[it] * kn[t] <= EXACT_ABOVE[dt]:   # scores too large to fold lse in: float64
                    p4[...] = _exact_probs(sh.q[:, :, a + r0:a + r1], sh.k[:, c:dd], lse3[:, :, a + r0:a + r1],
                                           scale, mask)
                else:
                    mm(qt, ka[:, c:dd].transpose(0, 2, 1), p)
                    if mask is not None:
                        p4 *= mask
                    if -qn[it] * kn[t] - top < floor:
                        np.clip(p, floor, None, out=p)
                    np.exp2(p, out=p)
                    if mask is not None:
                        p4 *= mask
                # dv += p^T dout   (the BLAS adds into dv: no temporary)
                mm(p.transpose(0, 2, 1), dot[..., :dv], dvv[:, c:dd], beta=1.0)
                # ds = p * (dout.v - delta)   (delta folded into the GEMM), into p
                mm(dot, va[:, c:dd].transpose(0, 2, 1), dp)
                np.multiply(p, dp, out=p)
                tick()                            # a backward tile is long: poll mid-way too
                # dq += ds k ; dk += ds^T (c2 q)   (scales applied at the end)
                into_dq = _rows_view(dq_acc, r0, r1)
                if into_dq is not None:
                    mm(p, ka[:, c:dd, :d], into_dq, beta=1.0)
                else:                             # GQA rows trimmed: not one strided batch
                    dqt = dqt_buf[:b * g * n * d].reshape(b, g * n, d)
                    mm(p, ka[:, c:dd, :d], dqt)
                    dq_acc[:, :, r0:r1] += dqt.reshape(b, g, n, d)
                mm(p.transpose(0, 2, 1), qt[..., :d], dk[:, c:dd], beta=1.0)
                tick()
            dq[:, :, a:e] = dq_acc
    dq *= scale
    dk *= LN2                                  # ds^T (c2 q) = scale*log2e * ds^T q
    return _unflatten_grads(dq, dk, dvv, sh)


def _exact_probs(q, k, lse, scale, mask):
    """Probabilities exp(scale q.k - lse) in float64 for rows q (b, g, n, d), keys k (b, cols, d).

    For tiles whose scores are too large for the fast path; at most 1 (lse is
    the log of the full row sum), 0 where masked or where the row sees no key.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        s = np.matmul(q.astype(np.float64), np.swapaxes(k, -1, -2)[:, None].astype(np.float64)) * scale
        p = np.exp(np.minimum(s - lse[..., None].astype(np.float64), 0))
    p[~np.isfinite(lse)] = 0
    return p if mask is None else p * mask


def _unflatten_grads(dq, dk, dv, sh):
    """Reshape flat gradients back to the shapes of q, k, v."""
    return dq.reshape(sh.lead + dq.shape[-2:]), dk.reshape(sh.k_shape), dv.reshape(sh.v_shape)
