"""One call of the student's function on this rank, and the attention cases built on it.

``call_student`` runs a call with a fresh strict communicator (``mpiring.testing.strict``), a
watchdog (``--time-limit``) and the clean-up every rank does together; ``run_forward_case`` /
``run_backward_case`` / ``run_merge_case`` build one case's arrays (the same on every rank), call
the student's function and check this rank's result against ``mpiring.testing``'s reference.
"""

import contextlib
import importlib.util
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from ... import shard_indices, testing
from ...testing.compare import where_text
from .diagnose import diagnose_backward, diagnose_layout, diagnose_merge
from .exercises import EXERCISES, Case, Exercise, make_cases
from .flops import Meter, counted, mark
from .sync import ACTIVE, Ledger, StrictComm, Stuck, drain, instrument, timed_sum

__all__ = ["EXERCISES", "Case", "Exercise", "Run", "call_student", "load_student", "make_cases", "run_backward_case",
           "run_forward_case", "run_merge_case"]


def load_student(path, function):
    """Import the student's file; its ``MPI`` (and ``Request``) names are pointed at the timed proxies."""
    path = os.path.abspath(path)
    name = "student_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None:
        raise ImportError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    folder = os.path.dirname(path)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec.loader.exec_module(module)
    for other in [module] + [m for m in list(sys.modules.values())  # the files it imported from its folder too
                             if os.path.dirname(os.path.abspath(getattr(m, "__file__", None) or "/")) == folder]:
        instrument(other)
    fn = getattr(module, function, None)
    if not callable(fn):
        raise TypeError(f"{os.path.basename(path)} defines no function {function}")
    return fn


def _student_trace(exc, path):
    """The traceback lines that lie in the student's file, and the exception itself."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == path]
    lines = [f"  {os.path.basename(f.filename)}, line {f.lineno}, in {f.name}: {(f.line or '').strip()}"
             for f in frames[-4:]]
    return "\n".join(lines + [f"  {type(exc).__name__}: {exc}"])


@dataclass
class Run:
    """What one rank saw in one call of the student's function."""

    outcome: str = "returned"  # returned | raised | stuck
    value: object = None
    error: str = ""
    exception: str = ""
    stuck: tuple | None = None  # (call, [(kind, peer, text)], seconds)
    bytes: int = 0
    messages: int = 0
    pickled: int = 0
    sent_to: dict = field(default_factory=dict)
    received_from: dict = field(default_factory=dict)
    collective_bytes: int = 0
    collectives: dict = field(default_factory=dict)
    calls: dict = field(default_factory=dict)
    world_calls: int = 0
    macs: int | None = None  # multiply-adds of the products counted (a counted call only)
    events: list | None = None  # the ledger's timeline (when asked for), times relative to the call's start
    left: list = field(default_factory=list)
    clean: bool = True


def _watchdog(limit, ledger, rank, what, last_words=None):
    def fire():
        sys.stdout.flush()
        sys.stderr.write(f"grade: rank {rank}: {what} has not returned after {limit:g} s (--time-limit); it is "
                         f"{ledger.state_text()}; aborting the job\n")
        sys.stderr.flush()
        time.sleep(1.0 + 0.2 * rank if rank else 0.0)  # rank 0 first: the job ends before the others repeat it
        if last_words is not None:
            last_words(f"{what} has not returned after {limit:g} s (--time-limit)")
        time.sleep(0.3)
        MPI.COMM_WORLD.Abort(4)

    timer = threading.Timer(limit, fire)
    timer.daemon = True
    timer.start()
    return timer


def call_student(call, gcomm, opts, what, meter=None, events=False):
    """Run ``call(comm)`` with a fresh strict communicator; every rank then cleans up together. Returns a Run.

    With a ``meter`` (``flops.Meter``), the products made during the call are counted in ``run.macs``
    (and are events of the timeline); ``events``: keep the ledger's timeline in ``run.events``.
    """
    from threadpoolctl import threadpool_limits

    scomm = gcomm.Dup()
    ledger = Ledger(opts.timeout, gcomm.Get_rank())
    ledger.on_object = mark
    if meter is not None:
        meter.ledger = ledger
    comm = StrictComm(scomm, ledger)
    run = Run()
    ACTIVE.ledger = ledger
    timer = _watchdog(opts.time_limit, ledger, gcomm.Get_rank(), what, getattr(opts, "last_words", None))
    start = time.perf_counter()
    try:
        with threadpool_limits(1), meter or contextlib.nullcontext():  # one BLAS thread: ranks share the cores
            run.value = call(comm)
    except Stuck as exc:
        run.outcome, run.stuck = "stuck", (exc.call, exc.waiting, exc.seconds)
    except (Exception, SystemExit) as exc:  # noqa: BLE001  any error of the student's is reported
        run.outcome = "raised"
        run.exception = f"{type(exc).__name__}: {exc}"
        run.error = _student_trace(exc, opts.path)
    finally:
        timer.cancel()
        ACTIVE.ledger = None
        run.macs = meter.macs if meter is not None else None
    run.bytes, run.messages, run.pickled = ledger.bytes, ledger.messages, ledger.pickled
    run.sent_to, run.received_from = dict(ledger.sent_to), dict(ledger.received_from)
    run.collective_bytes, run.collectives = ledger.collective_bytes, dict(ledger.collectives)
    run.calls, run.world_calls = dict(ledger.calls), ledger.world_calls
    if events:
        run.events = [{k: (v - start if k in ("t", "start", "end") and v is not None else v) for k, v in e.items()}
                      for e in ledger.events]
    run.left, run.clean = drain(gcomm, ledger, opts.sync_timeout)
    if run.clean:
        for c in ledger.comms:
            if c is not MPI.COMM_WORLD and c != MPI.COMM_NULL:
                c.Free()
    return run


def arrays(case, count, rows, heads=None, seed_offset=0):
    """``count`` arrays (heads, rows, D) drawn from the case's seed, the same on every rank."""
    rng = np.random.default_rng(case.seed + seed_offset)
    return [rng.standard_normal((heads or case.h, rows, case.d)).astype(case.dtype) for _ in range(count)]


def new_check():
    return {"ok": False, "error": None, "text": "", "hints": []}


def judge(check, got, ref, dtype, rank, what="out", rows=None, hints=None):
    """Fill ``check`` from this rank's result against the reference; ``hints()`` is asked only for a wrong one."""
    tol = testing.tolerance(dtype)
    err, index = testing.attention_error(got, ref, what)
    check.update(ok=err <= tol, error=err, index=index, tol=tol)
    if err > tol:
        check["text"] = (f"max error {err:.3g} on rank {rank} at {where_text(index, np.ndim(got), what, rows)}, "
                         f"tolerance {tol:g}")
        check["hints"] = hints() if hints else []
    return check


def run_forward_case(case, exercise, fn, gcomm, opts, check_output=True, count=False, events=False):
    """One forward case on this rank: (Run, check). ``count``: q, k, v are given as Counted arrays."""
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    S = case.n * P
    (Q,) = arrays(case, 1, S)
    K, V = arrays(case, 2, S, case.kv_heads, seed_offset=1)
    positions = [shard_indices(S, P, s, exercise.layout) for s in range(P)]
    idx = positions[rank]
    q, k, v = (np.ascontiguousarray(X[..., idx, :]) for X in (Q, K, V))
    given = counted if count else (lambda a: a)
    run = call_student(lambda comm: fn(given(q.copy()), given(k.copy()), given(v.copy()), comm, causal=case.causal),
                       gcomm, opts, exercise.function, Meter() if count else None, events)
    check = new_check()
    if run.outcome == "returned" and check_output:
        got = run.value
        if isinstance(got, tuple) and len(got) == 2 and np.shape(got[0]) == q.shape:
            got = got[0]  # (out, lse) is fine too
        if not isinstance(got, np.ndarray) or got.shape != q.shape:
            shape = got.shape if isinstance(got, np.ndarray) else type(got).__name__
            check["text"] = f"rank {rank} returned {shape}, expected an array of shape (H, n, D) = {q.shape}"
        else:
            ref, _ = testing.reference(q, K, V, causal=case.causal, q_positions=idx)
            judge(check, got, ref, case.dtype, rank, rows=idx, hints=lambda: diagnose_layout(
                got, ref, Q, K, V, idx, positions, case.causal, testing.tolerance(case.dtype), rank, exercise.group)
                or [])
    run.value = None
    return run, check


def run_backward_case(case, exercise, fn, gcomm, opts, events=False):
    P, rank = gcomm.Get_size(), gcomm.Get_rank()
    S = case.n * P
    Q, K, V, dO = arrays(case, 4, S)
    positions = [shard_indices(S, P, s, exercise.layout) for s in range(P)]
    idx = positions[rank]
    q, k, v, do = (np.ascontiguousarray(X[..., idx, :]) for X in (Q, K, V, dO))
    out, lse = (a.astype(case.dtype) for a in testing.reference(q, K, V, causal=case.causal, q_positions=idx))
    run = call_student(lambda comm: fn(do.copy(), q.copy(), k.copy(), v.copy(), out.copy(), lse.copy(), comm,
                                       causal=case.causal), gcomm, opts, exercise.function, events=events)
    # reference: each rank's queries contribute to every key's gradient; the contributions are summed
    dq, dk_part, dv_part = testing.reference_backward(do, q, K, V, causal=case.causal, q_positions=idx)
    dk_all = timed_sum(gcomm, dk_part, opts.sync_timeout)
    dv_all = timed_sum(gcomm, dv_part, opts.sync_timeout)
    check = new_check()
    if run.outcome == "returned":
        got = run.value
        if not (isinstance(got, (tuple, list)) and len(got) == 3
                and all(isinstance(g, np.ndarray) and g.shape == q.shape for g in got)):
            check["text"] = f"rank {rank} must return (dq, dk, dv), three arrays of shape {q.shape}"
        else:
            tol = testing.tolerance(case.dtype)
            refs = {"dq": dq, "dk": dk_all[..., idx, :], "dv": dv_all[..., idx, :]}
            errors = {name: testing.attention_error(g, refs[name], name) for name, g in zip(refs, got)}
            name, (err, index) = max(errors.items(), key=lambda item: item[1][0])
            check.update(ok=err <= tol, error=err, index=index, tol=tol)
            if err > tol:
                wrong = [nm for nm, (e, _) in errors.items() if e > tol]
                check["text"] = (f"{', '.join(wrong)} wrong: max relative error {err:.3g} in {name} on rank {rank} at "
                                 f"{where_text(index, got[0].ndim, name, idx)}, tolerance {tol:g}")
                check["hints"] = diagnose_backward(got, refs, errors, tol, dk_all, dv_all, dk_part, dv_part,
                                                    positions, idx, rank)
    run.value = None
    return run, check


MERGE_SHAPES = {  # name: (heads, queries, (keys in block 1, in block 2), score scale, empty blocks)
    "halves": (2, 16, (12, 12), 1.0, 0), "uneven blocks": (2, 16, (3, 29), 1.0, 0),
    "large scores (exp(lse) overflows)": (2, 16, (12, 12), 40.0, 0), "an empty block (lse = -inf)": (2, 16, (16, 16),
                                                                                                    1.0, 1),
    "both blocks empty": (2, 16, (16, 16), 1.0, 2), "float32": (2, 16, (12, 12), 1.0, 0),
}


def run_merge_case(case, fn, gcomm, opts, events=False):
    h, n, (a, b), scale, empty = MERGE_SHAPES[case.name]
    dtype = case.dtype
    causal = empty > 0
    rng = np.random.default_rng(case.seed)
    d = 8
    q, k, v = (rng.standard_normal((h, rows, d)) for rows in (n, a + b, a + b))
    q, k = q * scale, k * scale
    qpos, kpos = np.arange(n), np.arange(a + b)
    if causal:  # causal, with the empty blocks' keys after every query
        kpos = np.concatenate([np.arange(a) + (n if empty == 2 else 0), n + np.arange(b)])
    parts = [testing.reference(q, k[..., s, :], v[..., s, :], causal=causal, q_positions=qpos,
                               k_positions=kpos[s]) for s in (slice(0, a), slice(a, a + b))]
    ref_out, ref_lse = testing.reference(q, k, v, causal=causal, q_positions=qpos, k_positions=kpos)
    args = [x.astype(dtype) for part in parts for x in part]
    run = call_student(lambda comm: fn(*(x.copy() for x in args)), gcomm, opts, "merge", events=events)
    check = new_check()
    if run.outcome == "returned":
        got = run.value
        if not (isinstance(got, (tuple, list)) and len(got) == 2 and np.shape(got[0]) == ref_out.shape
                and np.shape(got[1]) == ref_lse.shape):
            check["text"] = f"merge must return (out, lse) with shapes {ref_out.shape} and {ref_lse.shape}"
        else:
            tol = testing.tolerance(dtype)
            err_o, i_o = testing.attention_error(got[0], ref_out, "out")
            err_l, i_l = testing.attention_error(got[1], ref_lse, "lse")
            err = max(err_o, err_l)
            check.update(ok=err <= tol, error=err, tol=tol)
            if err > tol:
                what = "out" if err_o >= err_l else "lse"
                index = i_o if what == "out" else i_l
                check["text"] = (f"{what}: max error {err:.3g} at {where_text(index, 3 if what == 'out' else 2, what)}"
                                 f", tolerance {tol:g}")
                check["hints"] = diagnose_merge(got, ref_out, ref_lse, parts, tol, causal, scale)
    run.value = None
    return run, check
