"""Comparing with the reference: the error, messages that say where it is, and one verdict on every rank.

A failure names the rank, the global position of the row (``positions``), the head, the batch
entry and the column; with a communicator every rank reaches the same verdict and rank 0's
message summarises every rank's failure, so pytest-mpi's per-rank reports do not interleave
different verdicts.
"""

import sys

import numpy as np

from ..core.ranks import ranks_text
from .expected import tolerance

__all__ = ["DEFAULT_ASSERT_TIMEOUT", "assert_attention_close", "assert_on_all_ranks", "attention_error",
           "where_text"]

DEFAULT_ASSERT_TIMEOUT = 60.0  # seconds a collective assertion waits for the other ranks


def attention_error(got, ref, what="out"):
    """``(max error, index of it)``: absolute for outputs and lse, relative to max(1, max|ref|) for gradients.

    NaN/Inf where the reference is finite counts as an infinite error; -inf lse where the
    reference also has -inf (a row that sees no key) counts as exact.
    """
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise AssertionError(f"{what}: shape {got.shape}, expected {ref.shape}")
    if got.size == 0:
        return 0.0, ()
    same = (got == ref) | (np.isnan(got) & np.isnan(ref))  # covers matching infinities
    with np.errstate(invalid="ignore"):
        err = np.where(same, 0.0, np.abs(got - ref))
    err = np.where(np.isnan(err), np.inf, err)
    if is_gradient(what):
        finite = ref[np.isfinite(ref)]
        err = err / max(1.0, float(np.max(np.abs(finite), initial=0.0)))
    index = np.unravel_index(int(np.argmax(err)), err.shape)
    return float(err[index]), tuple(int(i) for i in index)


def is_gradient(what):
    return what.lower().startswith(("dq", "dk", "dv", "grad", "d_"))


def where_text(index, ndim, what="out", positions=None, heads=None):
    """Where element ``index`` of a (..., H, S, D) result (lse: (..., H, S)) lies, in words.

    ``positions``: the global token position of each row (default: the row index); ``heads``: the
    global index of each head (head-sharded results). E.g. "global position 37 (row 5 here), head 2,
    column 3, batch entry 1".
    """
    index = tuple(index)
    if not index:
        return "an empty array"
    rows_axis = ndim - 1 if what.lower().startswith("lse") else ndim - 2
    if rows_axis < 0:
        return f"index {index}"
    row = index[rows_axis]
    if positions is not None:
        parts = [f"global position {int(np.asarray(positions)[row])} (row {row} here)"]
    else:
        parts = [f"row {row}"]
    if rows_axis >= 1:
        head = index[rows_axis - 1]
        parts.append(f"head {int(np.asarray(heads)[head]) if heads is not None else head}")
    if rows_axis == ndim - 2:
        parts.append(f"column {index[-1]}")
    if rows_axis >= 2:
        batch = index[:rows_axis - 1]
        parts.append(f"batch entry {batch[0] if len(batch) == 1 else batch}")
    return ", ".join(parts)


def _world_rank():
    """This process's rank in MPI.COMM_WORLD if MPI runs with more than one rank (never starts MPI)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() == 1:
        return None
    return mpi.COMM_WORLD.Get_rank()


def assert_attention_close(out, ref, dtype, what="out", wire=None, codings=1, *, positions=None, heads=None,
                           comm=None, hints=(), timeout=DEFAULT_ASSERT_TIMEOUT):
    """Raise AssertionError unless ``out`` is within ``tolerance(dtype, wire, codings)`` of the float64 ``ref``.

    ``dtype`` is the dtype the computation ran in (float32 work is judged by the float32 row even
    if it returns float64). Gradients (``what`` starting with dq, dk, dv, grad) are judged relative
    to max(1, max|ref|). The message names the largest error, the rank (under MPI), the global
    position (``positions`` of this rank's rows), head (``heads``: their global indices), column
    and the tolerance, then ``hints``; returns the error. ``wire``: the ``wire_dtype`` K/V travelled
    in (its bound applies too), ``codings`` as ``tolerance`` takes it. With ``comm``: a collective assertion
    (``assert_on_all_ranks``).
    """
    tol = tolerance(dtype, wire, codings)
    error, index = attention_error(out, ref, what)
    problem = None
    if not error <= tol:
        got = float(np.asarray(out, dtype=np.float64)[index])
        want = float(np.asarray(ref, dtype=np.float64)[index])
        kind = "relative error (to max(1, max|ref|))" if is_gradient(what) else "error"
        rank = comm.Get_rank() if comm is not None else _world_rank()
        name = np.dtype(dtype).name if dtype != "bfloat16" else dtype
        problem = (f"{what}: max {kind} {error:.3g}{'' if rank is None else f' on rank {rank}'} at "
                   f"{where_text(index, np.ndim(out), what, positions, heads)}, index {index} (got {got:.17g}, "
                   f"reference {want:.17g}) exceeds the {name}{_coded(wire, codings)} tolerance {tol:g}")
        problem += "".join(f"\n  hint: {h}" for h in hints)
    if comm is not None:
        assert_on_all_ranks(comm, problem, what, timeout)
    elif problem:
        raise AssertionError(problem)
    return error


def _coded(wire, codings):
    """The wire in an assertion's message: ' (int8 wire)', ' (int8 wire, 2 codings)', or nothing."""
    return f" ({wire} wire{f', {codings} codings' if codings != 1 else ''})" if wire else ""


def assert_on_all_ranks(comm, problem, what="check", timeout=DEFAULT_ASSERT_TIMEOUT):
    """One verdict on every rank of ``comm``: raise AssertionError everywhere if ``problem`` is set on any rank.

    ``problem``: None where this rank's check passed, else its message. Rank 0's message lists
    every failing rank's problem (the summary); the other ranks' messages only name the failing
    ranks, so per-rank reports agree and do not repeat each other. The ranks' problems are
    gathered with a timeout (a rank that never comes raises there instead of hanging).
    """
    from ..mpi.collectives import allgather

    real = getattr(comm, "mpi_comm", comm)  # a strict communicator: the one it wraps
    problems = allgather(real, problem, timeout)
    bad = [r for r, p in enumerate(problems) if p]
    if not bad:
        return
    size = len(problems)
    head = f"{what}: failed on {ranks_text(bad)} of {size}"
    if real.Get_rank() != 0:
        raise AssertionError(f"{head} (rank 0's report has every rank's message)")
    raise AssertionError(head + "".join(f"\n[rank {r}] {problems[r]}" for r in bad))
