"""Top-k attention under context parallelism: the indexer runs on every rank's own queries, the choice is shared.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_topk_mpi.py

``select_topk`` is collective. Every rank holds its shard of the indexer's
queries (and DSA's per-head weights) and keys, as it holds q, k and v. The
indexer keys are small (a few dozen values per token): they are all-gathered
once, so every rank scores its own queries against every key block of the
sequence (``plans.indexer.select``: the same bits for any number of ranks). Each
rank's choice, ``topk`` block indices per query, is all-gathered in turn, and
every rank returns the same ``Selected`` mask piece. Give it to any entry point
as ``mask=``; with ``mode="sparse"`` only the chosen keys travel (every rank
knows which of its keys each other rank's queries chose).

Bytes, counted in ``record`` as a ring all-gather moves them: the indexer keys,
``(P - 1) x`` this rank's ``index_k.nbytes``; the choice, ``(P - 1) x`` its
queries x k x 4 (int32 block indices).
"""

import time

import numpy as np

from ..core.buffers import flat_blocks, mpi_view
from ..core.record import Record
from ..mpi.agree import check_comm, setup_ring
from ..mpi.waits import exclusive, wait_until
from ..plans.checks import AUTO_BASE, AUTO_RATE, describe
from ..plans.indexer import Selected, select, topk_problem
from ..plans.layouts import take_rows
from ..plans.spec import Spec

__all__ = ["select_topk", "gathered_rows"]


def gathered_rows(a, shards, total, comm, rec, timeout, what, fill=0):
    """Every rank's rows ``a`` (..., n_r, d) put at their positions ``shards[r]`` of an array of ``total`` rows,
    by one all-gather (counted in ``rec`` as a ring all-gather moves it)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    flat, counts, views = flat_blocks(a, [len(s) for s in shards], a.dtype, empty=True)
    start = time.perf_counter()
    wait_until([comm.Iallgatherv(mpi_view(np.ascontiguousarray(a)), [mpi_view(flat), counts])], timeout, rank, what)
    rec.bytes_sent += a.nbytes * (size - 1)
    rec.messages += size - 1
    rec.event("send", start, step=0, stream=0, dest="all", bytes=a.nbytes * (size - 1), data=what)
    out = np.full(a.shape[:-2] + (total, a.shape[-1]), fill, a.dtype)
    for shard, view in zip(shards, views):
        out[..., shard, :] = view
    return out


def select_topk(index_q, index_k, comm=None, *, topk, block=1, weights=None, indexer="relu", causal=True,
                timeout="auto", record=None, **rows):
    """Each query's ``topk`` key blocks of ``block`` tokens, chosen by the indexer: a ``Selected`` mask piece, the
    same on every rank. Collective.

    Args:
        index_q: (heads, n, d) this rank's indexer queries, rows as its q's (``layout`` or ``positions``).
        index_k: (1, n_k, d) for ``indexer="relu"`` (DSA's shared key), (heads, n_k, d) for "mean"; rows as k's.
        weights: (heads, n) DSA's per-query head weights (default ones), "relu" only.
        topk, block: blocks kept per query, tokens per block (1: DSA's tokens).
        indexer: "relu" (DSA's lightning indexer) or "mean" (block-mean keys, MoBA's and NSA's selection).
        causal: rank only the blocks that start at or before the query (its own block is always kept).
        rows: ``seq_len``, ``layout``, ``positions``, ``kv_positions``: the tokens each rank holds, as
            ``ring_attention`` takes them (``Spec`` fields; another one is refused).
        timeout: as ``ring_attention``; record: a ``Record`` to count the bytes in.

    Bad input on any rank raises the same ValueError on every rank.
    """
    comm = check_comm(comm)
    rec = Record(comm.Get_rank()) if record is None else record
    with exclusive(comm):
        spec = problem = values = None
        try:
            spec = Spec.of(**rows, mode="allgather")
            problem = spec.beyond(("seq_len", "layout", "positions", "kv_positions", "mode"), "select_topk")
            problem = problem or topk_problem(topk, block, indexer, index_q, index_k, weights) or (
                spec.rows_problem(index_q, index_k))
            if problem is None:
                values = {"topk, block, indexer, causal": (int(topk), int(block), indexer, bool(causal)),
                          "index_q heads and dim": index_q.shape[::2], "index_k heads and dim": index_k.shape[::2],
                          "weights given": weights is not None}
        except (TypeError, ValueError) as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 (reported collectively, never raised alone)
            problem = describe(exc)
        plan = setup_ring(comm, spec, timeout, problem=problem, values=values)[0]
        rank = comm.Get_rank()
        start = time.perf_counter()
        q_pos = plan.shards[rank]
        scoring = 4.0 * plan.seq_len * max(map(len, plan.shards)) * index_q.shape[0] * index_q.shape[-1]
        wait = timeout if not isinstance(timeout, str) else AUTO_BASE + scoring / AUTO_RATE
        keys = gathered_rows(take_rows(index_k, plan.kv_orders[rank], -2), plan.kv_shards, plan.seq_len, comm, rec,
                             wait, "indexer keys")
        order = plan.orders[rank]
        chosen = select(take_rows(index_q, order, -2), keys, q_pos, topk=int(topk), block=int(block),
                        weights=None if weights is None else take_rows(weights, order, -1), indexer=indexer,
                        causal=bool(causal))
        rec.compute_time += rec.event("compute", start, kind="indexer") - start
        every = gathered_rows(chosen.astype(np.int32), plan.shards, plan.seq_len, comm, rec, wait,
                              "top-k choice", fill=-1)
        rec.wall_time = time.perf_counter() - start
        return Selected(every, int(block), bool(causal))
