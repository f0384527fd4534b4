"""The labs whose inputs are not a sequence shard of q, k, v: pass-Q, decode against a sharded cache, all-reduce.

Each ``run_*_case`` builds the case's arrays (the same on every rank), calls the student's
function through ``cases.call_student`` and checks this rank's result, with hints from the
numbers: a partial sent to the wrong rank, partials merged without the log-sum-exp weights or
left out, NaN from an empty shard, a chunk of the all-reduce missing a rank's part or counting
it twice.
"""

import functools
import itertools

import numpy as np

from ... import testing
from ...core.kernels import merge
from ...testing.locate import diagnose_forward
from .cases import arrays, call_student, judge, new_check

__all__ = ["run_allreduce_case", "run_decode_case", "run_passq_case"]


def _result(got, shape):
    if isinstance(got, tuple) and len(got) == 2 and np.shape(got[0]) == shape:
        got = got[0]  # (out, lse) is fine too
    return got if isinstance(got, np.ndarray) and got.shape == shape else None


def run_passq_case(case, exercise, fn, gcomm, opts, events=False):
    """Pass-Q: each rank holds m queries and n keys; all keys are visible (a prefill against a cache)."""
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    m, n = case.q_rows, case.n
    (Q,) = arrays(case, 1, m * P)
    K, V = arrays(case, 2, n * P, case.kv_heads, seed_offset=1)
    mine = [np.arange(r * m, (r + 1) * m) for r in range(P)]
    blocks = [np.arange(r * n, (r + 1) * n) for r in range(P)]
    q, k, v = Q[..., mine[rank], :], K[..., blocks[rank], :], V[..., blocks[rank], :]
    run = call_student(lambda comm: fn(q.copy(), k.copy(), v.copy(), comm), gcomm, opts, exercise.function,
                       events=events)
    check = new_check()
    if run.outcome == "returned":
        got = _result(run.value, q.shape)
        if got is None:
            check["text"] = f"rank {rank} must return its queries' output, shape (H, m, D) = {q.shape}"
        else:
            ref, _ = testing.reference(q, K, V)
            tol = testing.tolerance(case.dtype)

            def hints():
                for s in range(P):
                    if s != rank and testing.attention_error(got, testing.reference(Q[..., mine[s], :], K, V)[0])[0] \
                            <= 100 * tol:
                        return [("home", f"rank {rank} holds the output of rank {s}'s queries: send each partial "
                                         f"(out, lse) home to the rank whose queries it belongs to")]
                return diagnose_forward(got, ref, q, K, V, np.arange(m), blocks, False, tol, rank)

            judge(check, got, ref, case.dtype, rank, hints=hints)
    run.value = None
    return run, check


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(int)


def run_decode_case(case, exercise, fn, gcomm, opts, events=False):
    """Decode: the same m query rows on every rank, each rank a shard of the KV cache; rank 0 returns (out, lse)."""
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    lengths = case.extra["lengths"]
    edges = _offsets(lengths)
    (q,) = arrays(case, 1, case.q_rows)
    K, V = arrays(case, 2, int(edges[-1]), seed_offset=1)
    k, v = (np.ascontiguousarray(X[..., edges[rank]:edges[rank + 1], :]) for X in (K, V))
    run = call_student(lambda comm: fn(q.copy(), k.copy(), v.copy(), comm), gcomm, opts, exercise.function,
                       events=events)
    check = new_check()
    if rank != 0:
        check.update(ok=True)  # only rank 0's result is asked for
    elif run.outcome == "returned":
        got = run.value
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and np.shape(got[0]) == q.shape
                and np.shape(got[1]) == q.shape[:-1]):
            check["text"] = f"rank 0 must return (out, lse) of shapes {q.shape} and {q.shape[:-1]}"
        else:
            ref, ref_lse = testing.reference(q, K, V)
            parts = [testing.reference(q, K[..., edges[r]:edges[r + 1], :], V[..., edges[r]:edges[r + 1], :])
                     for r in range(P)]
            tol = testing.tolerance(case.dtype)
            judge(check, got[0], ref, case.dtype, 0, hints=lambda: _decode_hints(got, parts, tol, lengths))
            if check["ok"]:
                judge(check, got[1], ref_lse, case.dtype, 0, "lse", hints=lambda: [
                    ("lse", "lse = log(sum over ranks of exp(lse_r)), computed as m + log(sum exp(lse_r - m))")])
    run.value = None
    return run, check


def _decode_hints(got, parts, tol, lengths):
    out = np.asarray(got[0], dtype=np.float64)
    if not np.all(np.isfinite(out)):
        empty = [r for r, n in enumerate(lengths) if n == 0]
        why = f" (rank {empty[0]}'s shard is empty: its lse is -inf)" if empty else ""
        return [("nan", f"NaN/Inf in the output{why}: exp(lse_a - m) with m = max(lse_a, lse_b) is fine, "
                        f"exp(-inf - (-inf)) is not: guard the merge where both lse are -inf")]
    visible = [r for r, n in enumerate(lengths) if n]
    if testing.attention_error(out, np.mean([parts[r][0] for r in visible], axis=0))[0] <= 100 * tol:
        return [("merge", "the partials are averaged: weight each by exp(lse_r - lse), lse the merged log-sum-exp")]
    for size in range(len(visible) - 1, 0, -1):
        for subset in itertools.combinations(visible, size):
            merged = functools.reduce(lambda a, b: merge(*a, *b), [parts[r] for r in subset])[0]
            if testing.attention_error(out, merged)[0] <= 100 * tol:
                left = sorted(set(visible) - set(subset))
                return [("missing", f"the result is the exact merge of ranks {list(subset)} only: the partials of "
                                    f"ranks {left} never reached rank 0")]
    return []


def run_allreduce_case(case, exercise, fn, gcomm, opts, events=False):
    """All-reduce: every rank's x (N elements), the sum on every rank."""
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    N = case.extra["N"]
    xs = [np.random.default_rng(case.seed * 100 + r).standard_normal(N).astype(case.dtype) for r in range(P)]
    run = call_student(lambda comm: fn(xs[rank].copy(), comm), gcomm, opts, exercise.function, events=events)
    check = new_check()
    if run.outcome == "returned":
        got = run.value
        if not isinstance(got, np.ndarray) or got.shape != (N,):
            shape = got.shape if isinstance(got, np.ndarray) else type(got).__name__
            check["text"] = f"rank {rank} returned {shape}, expected the summed array of shape ({N},)"
        else:
            want = np.sum([x.astype(np.float64) for x in xs], axis=0)
            tol = testing.tolerance(case.dtype)
            err, index = testing.attention_error(got, want)
            check.update(ok=err <= tol, error=err, index=index, tol=tol)
            if err > tol:
                check["text"] = f"max error {err:.3g} on rank {rank} at element {index[0]}, tolerance {tol:g}"
                check["hints"] = _chunk_hints(got, xs, tol, rank)
    run.value = None
    return run, check


def _chunk_hints(got, xs, tol, rank):
    """Which chunk (of np.array_split's P) is wrong, and which ranks' parts it holds."""
    P = len(xs)
    got = np.asarray(got, dtype=np.float64)
    for c, idx in enumerate(np.array_split(np.arange(len(got)), P)):
        parts = [x[idx].astype(np.float64) for x in xs]
        if len(idx) == 0 or np.max(np.abs(got[idx] - sum(parts))) <= tol:
            continue
        span = f"chunk {c} (elements {idx[0]}..{idx[-1]})"
        for counts in itertools.product(range(3), repeat=P):
            if np.max(np.abs(got[idx] - sum(k * p for k, p in zip(counts, parts)))) <= 100 * tol:
                missing = [r for r, k in enumerate(counts) if k == 0]
                twice = [r for r, k in enumerate(counts) if k == 2]
                text = f"{span} on rank {rank} holds" + (f" no part of ranks {missing}" if missing else "") + \
                    (" and" if missing and twice else "") + (f" the part of ranks {twice} twice" if twice else "")
                return [("chunk", text + ": in the reduce-scatter, at step t rank r sends chunk (r - t) mod P and adds "
                                         "what it receives into chunk (r - t - 1) mod P; then the all-gather passes "
                                         "the finished chunks on without adding")]
        return [("chunk", f"{span} is wrong on rank {rank}")]
    return []
