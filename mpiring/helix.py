"""Helix decoding: K/V sharded by sequence over a KVP group, query heads split over a TP group, one all-to-all.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_helix_mpi.py

NVIDIA's Helix parallelism (2025) lays the P ranks out as a KVP x TP grid
(``HelixGrid``): rank r has TP index r % TP and KVP index r // TP. The ranks
with one TP index form a KVP group and share one slice of the heads (Hq / TP
query heads, Hk / TP K/V heads); within the group each rank holds its own
shard of the sequence's K/V. ``helix_attention``:

1. every rank attends its TP slice of the new queries to its K/V shard: a
   float64 partial ``(out, lse)`` (``decode.local_partial``, the ring's kernel);
2. one all-to-all in the KVP group: the Hq / TP heads are cut into KVP
   parts, part j goes to the group's rank j, so each rank receives every
   shard's partial of its Hq / (TP KVP) heads;
3. each rank merges what it received in rank order (``decode.lse_merge``) and
   ends with whole attention for those heads, as Helix has it before the
   feed-forward layers (which then run tensor-parallel over all P ranks).

HOP-B (Helix's batch-wise overlap): with ``chunks=c`` the batch is cut into c
parts; the all-to-all of part i runs while part i + 1 is computed. The time
model is ``cost.infercost.helix_time``.
"""

import time

import numpy as np
from mpi4py import MPI

from .core.record import Record
from .decode import decode_agreement, decode_timeout, local_partial, lse_merge
from .mpi.agree import agreed, check_comm
from .mpi.decoding import Decoding
from .mpi.waits import exclusive, wait_until
from .plans.checks import Shown, describe

__all__ = ["HelixGrid", "helix_attention"]


class HelixGrid:
    """The KVP x TP grid of ``comm``: ``kvp`` (the ranks sharing a head slice, ``comm.rank % tp`` alike) and
    ``tp`` (one rank of each KVP group). Collective; ``free()`` (or ``with``) releases both communicators."""

    def __init__(self, comm, tp):
        comm = check_comm(comm)
        size, rank = comm.Get_size(), comm.Get_rank()
        ok = not isinstance(tp, bool) and isinstance(tp, (int, np.integer)) and tp >= 1 and size % tp == 0
        with exclusive(comm):  # every rank's tp the same: else ranks would pair up with the wrong heads
            agreed(comm, None if ok else f"tp must be a positive divisor of the {size} ranks, got {tp!r}",
                   {"tp": Shown(tp)} if ok else None, entry=True)
        self.comm, self.tp_size, self.kvp_size = comm, int(tp), size // int(tp)
        self.kvp = comm.Split(rank % self.tp_size, rank)  # same head slice, the sequence's shards
        self.tp = comm.Split(rank // self.tp_size, rank)  # same sequence shard, the head slices
        self.tp_rank, self.kvp_rank = self.tp.Get_rank(), self.kvp.Get_rank()

    def free(self):
        for c in (self.kvp, self.tp):
            if c != MPI.COMM_NULL:
                c.Free()
        self.kvp = self.tp = MPI.COMM_NULL

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()


def helix_attention(
    q: np.ndarray,  # (B, Hq / TP, T, D): this TP slice of the new queries, the same on every rank of the KVP group
    k: np.ndarray,  # (B, Hk / TP, n, D): this rank's shard of the cache, its TP slice of K/V heads, any n >= 0
    v: np.ndarray,  # (B, Hk / TP, n, Dv)
    grid: HelixGrid, *, chunks: int = 1, scale: float | None = None, timeout: float | str | None = "auto",
    record: Record | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # out (B, Hq / (TP KVP), T, Dv), lse (B, Hq / (TP KVP), T)
    """Whole attention for this rank's heads: part ``grid.kvp_rank`` of its TP slice (see the module).

    ``chunks``: HOP-B's batch parts, 1 <= chunks <= B (1: no overlap). Bad input on any rank
    raises the same ValueError on every rank of its KVP group, then on every rank of the grid.
    """
    kvp, n = grid.kvp, grid.kvp_size
    with exclusive(grid.comm):
        problem = None
        try:
            if isinstance(chunks, bool) or not isinstance(chunks, (int, np.integer)) or not 1 <= chunks <= len(q):
                problem = f"chunks must be an integer from 1 to the batch ({len(q)}), got {chunks!r}"
            elif q.ndim != 4 or q.shape[1] % n:
                problem = f"q must be (batch, heads, tokens, dim) with heads a multiple of KVP = {n}, got {q.shape}"
        except Exception as exc:  # reported collectively, never raised alone
            problem = describe(exc)
        message = None
        try:
            scale, lengths, _ = decode_agreement(kvp, q, k, v, Decoding(scale, timeout), problem=problem,
                                                 values={"chunks": Shown(chunks)})
        except ValueError as exc:
            message = f"KVP group {grid.tp_rank}: {exc}"
        # every group hears of any group's error, and the options are the same in every group
        agreed(grid.comm, message, None if message else {"chunks": Shown(chunks), "timeout": Shown(timeout)}, timeout)
        timeout = decode_timeout(timeout, q, v, lengths)
        rec = Record(grid.comm.Get_rank()) if record is None else record
        start = time.perf_counter()
        q, k, v = (np.ascontiguousarray(a) for a in (q, k, v))
        parts = np.array_split(np.arange(len(q)), chunks)
        results, pending = [], None
        for part in parts:  # HOP-B: compute this part while the previous part's all-to-all runs
            began = time.perf_counter()
            out, lse = local_partial(q[part], [(k[part], v[part], None)], scale)
            rec.compute_time += rec.event("compute", began, kind="helix", batch=len(part)) - began
            sent = _by_destination(out, lse, n)
            received = np.empty_like(sent)
            request = kvp.Ialltoall(sent, received)
            rec.bytes_sent += sent.nbytes // n * (n - 1)
            rec.messages += n - 1
            if pending is not None:
                results.append(_finished(*pending, timeout, kvp.Get_rank(), rec))
            pending = (request, received, sent, time.perf_counter())  # sent: alive until its all-to-all completes
        results.append(_finished(*pending, timeout, kvp.Get_rank(), rec))
        rec.wall_time = time.perf_counter() - start
        out = np.concatenate([r[0] for r in results]).astype(q.dtype)
        lse = np.concatenate([r[1] for r in results]).astype(q.dtype)
        return out, lse


def _by_destination(out, lse, n):
    """(n, B, H / n, T, Dv + 1) float64 rows [out, lse]: part j of the heads, for the group's rank j."""
    B, H, T, dv = out.shape
    rows = np.empty((B, H, T, dv + 1), np.float64)
    rows[..., :-1], rows[..., -1] = out, lse
    return np.ascontiguousarray(np.moveaxis(rows.reshape(B, n, H // n, T, dv + 1), 1, 0))


def _finished(request, received, _sent, began, timeout, rank, rec):
    """Wait for one part's all-to-all and merge the partials received in rank order: ``(out, lse)``."""
    wait_until([request], timeout, rank, "helix all-to-all")
    rec.event("alltoall", began)
    merged = received[0].reshape(-1, received.shape[-1]).copy()
    for part in received[1:]:
        lse_merge(part.reshape(merged.shape), merged)
    merged = merged.reshape(received.shape[1:])
    return merged[..., :-1], merged[..., -1]
