"""Grade a ring attention written by a student: right answers, a ring's traffic, and no unsafe MPI.

    mpiexec -n 4 python -m mpiring.tools.grade student.py
    mpiexec -n 4 python -m mpiring.tools.grade --exercise merge examples/exercises/01_merge.py
    mpiexec -n 3 python -m mpiring.tools.grade --quick --timeout 2 student.py

``student.py`` defines ``ring_attention(q, k, v, comm, causal=False)``: q, k, v are this rank's
contiguous shard (H, n, D) of a sequence of n * P tokens, and it returns this rank's output
(H, n, D). The grader runs it on a matrix of cases (messages of n * H * D * itemsize bytes from
1 KiB to 1 MiB, float32 and float64, causal and not) on as many ranks as it was launched with,
and checks, per case:

- output: every rank's output against ``mpiring.testing.reference`` within ``testing.TOLERANCE``;
  a wrong one is classified from the numbers (merged without the log-sum-exp rescale, a causal
  mask shifted by a block, a block missing, the wrong softmax scale, NaN) and gets a hint;
- traffic: the bytes each rank sent through ``comm`` against the cost model, (P - 1) K/V blocks
  per rank, i.e. 2 (P - 1) messages of n * H * D * itemsize bytes;
- safety: every rank returned, without an exception, a stuck call or an unfinished request;
- work (``--exercise causal`` and ``zigzag``): the query-key pairs each rank computed, counted
  exactly from the multiply-adds of its matrix products (q, k, v are given as an ndarray subclass
  that tallies them, ``flops``), against ``mpiring.make_plan``; no timing is involved.

``comm`` is a wrapper that forwards mpi4py's Comm methods and counts what is sent. It runs every
send in synchronous mode (``Send`` as ``Ssend``, ``Isend`` as ``Issend``, MPI's advice for
testing a program's buffering assumptions), so a ring in which every rank sends before it
receives deadlocks at every size instead of only above the eager limit; every blocking call
polls with a deadline (``--timeout``), so a stuck ring is reported ("unsafe: rank 0 blocked in
Send to rank 1 for 5 s ...") and the job still ends, on every rank, with a non-zero exit code.
``MPI.Request.Waitall`` and friends, looked up through the ``MPI`` name of the student's module,
are timed too; anything else that never returns is ended by ``--time-limit`` (comm.Abort).

``--exercise NAME`` grades one exercise of docs/exercises.md instead (merge, ring, causal,
zigzag, bidirectional, backward). Exit code 0 only if every check passes, on every rank.
Output is printed by rank 0.

The package: ``wire`` (the student's communicator), ``sync`` (the grader's own exchanges),
``cases`` (exercises, the case matrix, one call of the student's function), ``diagnose`` (hints
for wrong outputs), ``verdicts`` (safety, output, traffic), ``flops`` (the counting arrays),
``work`` (the work checks),
``report`` (what rank 0 prints); here the command line and the loop over the cases.
"""

import argparse
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from .cases import EXERCISES, MERGE_CASES, load_student, make_cases, run_backward_case, run_forward_case, run_merge_case
from .report import say, show, summary
from .sync import Lost, allgather, fatal
from .verdicts import Verdict, output_verdict, safety_verdict, traffic_verdict
from .wire import DEFAULT_TIMEOUT, GradedComm, TimedRequest, size_text
from .work import measure_work, work_verdict

__all__ = ["EXERCISES", "GradedComm", "TimedRequest", "grade", "main", "parser"]

DEFAULT_TIME_LIMIT = 120.0  # seconds one call of the student's function may take in all


@dataclass
class Options:
    path: str
    timeout: float
    time_limit: float

    @property
    def sync_timeout(self):
        """How long the grader waits for the other ranks: longer than any student call may take."""
        return self.time_limit + 2 * self.timeout + 30


class _Parser(argparse.ArgumentParser):
    """Prints usage and errors on rank 0 only."""

    rank = 0

    def _print_message(self, message, file=None):
        if self.rank == 0:
            super()._print_message(message, file)


def parser(rank=0):
    p = _Parser(prog="python -m mpiring.tools.grade", description=__doc__.splitlines()[0])
    p.rank = rank
    p.add_argument("student", help="the student's .py file")
    p.add_argument("--exercise", default="forward", choices=list(EXERCISES),
                   help="what to grade: forward (default, ring_attention causal and not) or an exercise of "
                        "docs/exercises.md")
    p.add_argument("--quick", action="store_true", help="4 cases instead of the full matrix")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds one MPI call may block before the ring is declared stuck "
                        f"(default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                   help=f"seconds one call of the student's function may take; past it the job is aborted "
                        f"(default {DEFAULT_TIME_LIMIT:g})")
    return p


def grade(comm, argv):
    """Grade ``argv``'s student file on ``comm`` (all ranks); returns the exit code, the same on every rank."""
    rank = comm.Get_rank()
    try:
        args = parser(rank).parse_args(argv)
    except SystemExit as exc:
        return exc.code
    if not (args.timeout > 0 and args.time_limit > 0):
        say(rank, "grade: --timeout and --time-limit must be positive")
        return 2
    opts = Options(os.path.abspath(args.student), args.timeout, args.time_limit)
    gcomm = comm.Dup()
    try:
        code = _grade(gcomm, EXERCISES[args.exercise], args.quick, opts)
    except Lost as exc:
        fatal(comm, str(exc))
    if code is None:  # a collective of the student's could not be cleaned up: end the job the hard way
        fatal(comm, "the student's code left an MPI collective unfinished", code=1)
    gcomm.Free()
    return code


def _grade(gcomm, exercise, quick, opts):
    rank, P = gcomm.Get_rank(), gcomm.Get_size()
    name = os.path.relpath(opts.path) if not os.path.relpath(opts.path).startswith("..") else opts.path
    try:
        fn, problem = load_student(opts.path, exercise.function), None
    except Exception as exc:  # noqa: BLE001  reported, then every rank exits 1
        fn, problem = None, f"cannot load {name}: {type(exc).__name__}: {exc}"
    problems = [p for p in allgather(gcomm, problem, opts.sync_timeout, "loading the student's file") if p]
    if problems:
        say(rank, f"grade: {problems[0]}")
        say(rank, f"it must define {exercise.signature}")
        return 1
    start = time.perf_counter()
    if exercise.kind == "merge":
        cases = list(range(len(MERGE_CASES)))
        labels = [f"merge: {c[0]} ({np.dtype(c[5]).name})" for c in MERGE_CASES]
        checks = ("output", "safety")
    else:
        cases = make_cases(exercise, quick)
        labels = [f"{c.label} ({size_text(c.message)}/msg)" for c in cases]
        checks = ("output", "traffic", "safety")
    say(rank, f"grading {name}: {exercise.name} ({exercise.title}), P = {P}, {len(cases)} cases, "
               f"timeout {opts.timeout:g} s")
    say(rank, f"  {exercise.signature}")
    table, hints, clean, stopped = [], {}, True, False
    for i, case in enumerate(cases):
        if exercise.kind == "merge":
            run, check, _, _ = run_merge_case(case, fn, gcomm, opts)
        elif exercise.kind == "backward":
            run, check = run_backward_case(case, exercise, fn, gcomm, opts)
        else:
            run, check = run_forward_case(case, exercise, fn, gcomm, opts)
        everyone = allgather(gcomm, (run, check), opts.sync_timeout)
        runs = [r for r, _ in everyone]
        safety = safety_verdict(runs)
        verdicts = {"output": output_verdict([c for _, c in everyone]) if safety.status == "ok"
                    or all(r.outcome == "returned" for r in runs) else Verdict("not run")}
        if "traffic" in checks:
            verdicts["traffic"] = traffic_verdict(case, exercise, runs)
        verdicts["safety"] = safety
        table.append((labels[i], verdicts))
        line = " | ".join(f"{n} {v.status}" + (f" ({v.short})" if v.short and v.status != "not run" else "")
                          for n, v in verdicts.items())
        say(rank, f"[{i + 1:2d}/{len(cases)}] {labels[i]}: {line}")
        show(rank, verdicts)
        for v in verdicts.values():
            for kind, text in v.hints:
                hints.setdefault(kind, text)
        clean = all(r.clean for r in runs)
        if any(r.outcome != "returned" for r in runs):
            for label in labels[i + 1:]:
                table.append((label, {n: Verdict("not run") for n in checks}))
            say(rank, f"stopped: the remaining {len(cases) - i - 1} cases are not run")
            stopped = True
            break
    if exercise.work:
        title = "work: causal skipping" if exercise.work == "skip" else "work: zigzag balance"
        work = work_verdict(exercise, None if stopped else measure_work(exercise, fn, gcomm, opts))
        table.append((title, {"output": work}))
        say(rank, f"{title}: {work.status}" + (f" ({work.short})" if work.short else ""))
        show(rank, {"work": work})
        for kind, text in work.hints:
            hints.setdefault(kind, text)
    summary(rank, table, checks, P, time.perf_counter() - start, hints)
    passed = all(v.status in ("ok", "not judged") for _, verdicts in table for v in verdicts.values())
    if not clean:
        return None
    return 0 if passed else 1


def main(argv=None):
    return grade(MPI.COMM_WORLD, sys.argv[1:] if argv is None else argv)
