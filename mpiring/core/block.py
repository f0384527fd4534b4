"""One K/V block into a rank's running results: the forward (out, lse) or the gradients. No MPI.

Every way of moving data (the ring, the bidirectional ring, the all-gather,
the one-process simulator) calls these with the block it holds; the loops only
decide which block, when. Tests wrap ``attend`` or ``block_grads`` to inject faults.
"""

import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .backends import attention_block, attention_block_backward, delta_is_rowsum
from .mla import Expanded
from .scores import attend_general, count_allowed, grads_general
from .tiles import BlockRun, filled, kernel_dtype, scratch

__all__ = ["DELTA_DTYPE", "KEPT_OUT", "Rowsum", "Queries", "Visit", "queries", "accumulators", "count_pairs",
           "attend", "block_grads", "add_grads", "grads_of"]

DELTA_DTYPE = np.dtype(np.float64)  # delta = rowsum(dout * out) is summed in this, then cast to the input's
KEPT_OUT = "ring.out"  # the kept buffer of the forward's running out; the backward sums dq in it


def accumulators(q, v, out_dtype=np.float64, lse_dtype=None, keep=False, wire=None):
    """Running (out, lse), in float64 by default whatever the input dtype, as flash-attn keeps fp32 for fp16:
    with fp32 ones the merge's rounding made the error grow with P (docs/reliability.md). ``lse_dtype``:
    that of out unless given (``precision.Precision`` keeps lse in float32 when out is in a half dtype).
    ``keep``: out in this thread's kept buffer (``tiles.filled``), for a caller that returns a converted copy.
    ``wire``: the call's; out has v's head dim, or the ``value_dim`` of a wire that expands blocks (``latent``)."""
    shape = q.shape[:-1] + (getattr(wire, "value_dim", v.shape[-1]),)
    lse_dtype = lse_dtype or out_dtype
    out = filled(KEPT_OUT if keep else None, shape, np.dtype(out_dtype), 0)
    return [out, np.full(q.shape[:-1], -np.inf, lse_dtype)]


def count_pairs(record, pieces):
    """Note the score entries of a block's pieces, and how many of them the mask lets through."""
    for piece in pieces:
        a, b, c, d, where = piece.q0, piece.q1, piece.k0, piece.k1, piece.where
        record.computed_pairs += (b - a) * (d - c)
        klo, khi = piece.klo, piece.khi
        if where is not None and where.mask is not None:  # holes: counted from the mask's definition
            record.visible_pairs += int(count_allowed(where.mask, where.q_pos[a:b], where.k_pos[c:d],
                                                      *_envelope(klo, khi, b - a, d - c))[0].sum())
        else:
            record.visible_pairs += (b - a) * (d - c) if klo is None else int(np.sum(khi - klo))


def _envelope(klo, khi, n, m):
    return (np.zeros(n, np.int64), np.full(n, m, np.int64)) if klo is None else (klo, khi)


def general(score, piece):
    """Whether a piece needs the general kernel (``core.scores``): a score modifier, or a mask with holes."""
    return not score.plain or (piece.where is not None and piece.where.mask is not None)


@dataclass(frozen=True)
class Visit:
    """One K/V block's turn in a loop: its ``step``, its plan ``task`` (source, kind, stream) and the ``pieces``
    of it that this rank's queries see."""
    step: int | None
    task: object
    pieces: list


def attend(q, kv, visit, score, acc, record, progress, padded=False):
    """Attend this rank's queries to the ``pieces`` of one K/V block's ``Visit`` and merge into ``acc`` =
    [out, lse].

    The kernel merges every finished query tile into the running (out, lse)
    with ``merge`` (the log-sum-exp rule), so no block-sized output is made.
    ``padded``: k and v are the ring's [k | 1]^T, [v | 1]^T blocks (``comm.KVBuffers``).
    """
    step, task, pieces = visit.step, visit.task, visit.pieces
    if task.kind != "skip":
        start = time.perf_counter()
        k, v = kv
        count_pairs(record, pieces)
        run = BlockRun(progress=progress)
        for piece in pieces:
            if general(score, piece):
                attend_general(q, k, v, piece, score, acc[:2], padded)
                continue
            a, b, c, d = piece.q0, piece.q1, piece.k0, piece.k1
            keys = np.s_[..., c:d] if padded else np.s_[..., c:d, :]  # padded: tokens on the last axis
            attention_block(q[..., a:b, :], k[keys], v[keys], score.scale, piece.klo, piece.khi, padded=padded,
                            into=(acc[0][..., a:b, :], acc[1][..., a:b]), run=run)
        end = record.event("compute", start, step=step, source=task.source, kind=task.kind, stream=task.stream)
        record.compute_time += end - start
    record.tasks.append((step, task))


class Rowsum(np.ndarray):
    """A backward's delta that its caller computed as rowsum(dout * out) of the call's own dout and out, all
    finite (``queries`` then skips checking it). Views and slices keep the mark, computed values drop it."""

    def __array_wrap__(self, array, context=None, return_scalar=False):
        array = array.view(np.ndarray)
        return array[()] if return_scalar else array


class Queries(NamedTuple):
    """A rank's arrays that stay home in a backward pass, and whether ``delta`` is rowsum(dout * out) for them
    (None: not asked, each block's kernel backend checks its rows)."""
    dout: np.ndarray
    q: np.ndarray
    out: np.ndarray
    lse: np.ndarray
    delta: np.ndarray
    rowsum: bool | None = None


def queries(dout, q, out, lse, delta):
    """``Queries`` of a backward call, delta checked once for all its blocks where torch's op may take them
    (the op computes rowsum(dout * out) itself; a check per block costs more, docs/performance.md §21). A
    ``Rowsum`` delta, computed by the call itself, is not checked (§22)."""
    if isinstance(delta, Rowsum):
        return Queries(dout, q, out, lse, delta.view(np.ndarray), True)
    return Queries(dout, q, out, lse, delta, delta_is_rowsum(dout, q, out, delta))


def block_grads(queries, kv, pieces, score, dq, progress):
    """This rank's queries against ``pieces`` of one K/V block: add into ``dq``, return the keys' shares.

    ``queries``: this rank's arrays that never move, ``Queries`` or ``(dout, q, out, lse, delta)``.
    Returns ``[(c, d, dk, dv), ...]``, the kernel's dK and dV of keys c:d (in
    the compute dtype); ``add_grads`` adds them into the block's partial.
    """
    dout, q, out, lse, delta = queries[:5]
    rowsum = queries.rowsum if isinstance(queries, Queries) else None
    k, v = kv
    grads = []
    dt = kernel_dtype(q.dtype)
    for i, piece in enumerate(pieces):  # the kernel writes into kept buffers, one set per piece
        a, b, c, d = piece.q0, piece.q1, piece.k0, piece.k1
        if general(score, piece):
            bq, bk, bv = grads_general(dout, q, k, v, out, lse, delta, piece, score)
            dq[..., a:b, :] += bq
            grads.append((c, d, bk, bv))
            progress()
            continue
        kept = (scratch("grads.q", q[..., a:b, :].shape, dt), scratch(f"grads.k{i}", k[..., c:d, :].shape, dt),
                scratch(f"grads.v{i}", v[..., c:d, :].shape, dt))
        bq, bk, bv = attention_block_backward(dout[..., a:b, :], q[..., a:b, :], k[..., c:d, :], v[..., c:d, :],
                                              out[..., a:b, :], lse[..., a:b], score.scale, piece.klo, piece.khi,
                                              delta=delta[..., a:b], buffers=kept,
                                              run=BlockRun(progress=progress, rowsum=rowsum))
        dq[..., a:b, :] += bq
        grads.append((c, d, bk, bv))
        progress()
    return grads


def add_grads(total, grads):
    """Add ``block_grads``' shares into ``total = (dk, dv)``, the block's partial (float64 at home, else the
    ``grad_wire_dtype``), in place."""
    for c, d, bk, bv in grads:
        total[0][..., c:d, :] += bk
        total[1][..., c:d, :] += bv


def grads_of(queries, kv, visit, score, dq, record, progress, **info):
    """``block_grads`` of one block's ``Visit`` (or key chunk of it), noted as a "compute" event; [] if nothing
    to compute."""
    if not visit.pieces:
        return []
    start = time.perf_counter()
    grads = block_grads(queries, kv, visit.pieces, score, dq, progress)
    if isinstance(kv, Expanded):  # a latent block expanded per head: its gradients go back to the latent
        grads = kv.fold(grads)
    task = visit.task
    info = {"step": visit.step, "source": task.source, "kind": task.kind, "stream": task.stream, "pass": "backward",
            **info}
    end = record.event("compute", start, **info)
    record.compute_time += end - start
    return grads
