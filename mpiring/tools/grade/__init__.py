"""Grade students' distributed attention (and the labs of docs/course.md): right answers, traffic, no unsafe MPI.

    mpiexec -n 4 python -m mpiring.tools.grade student.py
    mpiexec -n 4 python -m mpiring.tools.grade --exercise merge examples/exercises/01_merge.py
    python -m mpiring grade class/ --ranks 2,3,4 --report report.json     # starts the MPI jobs itself

Under ``mpiexec -n P`` every file given (or found in a folder given) is graded at P, one after
another, in that job. With ``--ranks`` the grader runs outside MPI and starts one job per P
(``batch``), each grading all the files; a job that a file aborts (``--time-limit``) is started
again for the files after it. The report (``--report``: JSON, ``--csv``) has one entry per file
and P: verdict "pass"/"fail", the counts of checks, the hints, every case's checks.

``student.py`` defines the exercise's function (``EXERCISES``; the default, ``forward``:
``ring_attention(q, k, v, comm, causal=False)``: q, k, v are this rank's contiguous shard (H, n, D)
of a sequence of n * P tokens, H a multiple of P, and it returns this rank's output). A file may
name its exercise (``EXERCISE = "causal"``); ``--exercise`` overrides that. Per case:

- output: every rank's result against ``mpiring.testing.reference`` within ``testing.TOLERANCE``;
  a wrong one is classified from the numbers (merged without the log-sum-exp rescale, a K/V block
  skipped or masked wrongly, the wrong scale, NaN, heads or rows put back in the wrong place) and
  gets a hint;
- traffic: the bytes each rank sent against the exercise's cost model (decode: the rounds of its
  merge tree);
- safety: every rank returned, without an exception, a stuck call or an unfinished request;
- work (``causal``, ``zigzag``) and overlap (``ring``): from one more call with counting arrays
  (``flops``): the query-key pairs each rank computed against ``mpiring.make_plan``, and whether
  each send was in flight while the rank computed (the strict communicator's timeline).

``comm`` is ``mpiring.testing``'s strict communicator: sends in synchronous mode (a ring in which
every rank sends before it receives deadlocks at every size), every blocking call timed
(``--timeout``: "Send to rank 1 (tag 0, 1 KiB) blocked for 5.0 s (timeout 5 s)"), and anything
else that never returns is ended by ``--time-limit`` (comm.Abort), after the summary so far.

The package: ``exercises`` (the labs and their cases), ``wire`` (the student's communicator),
``sync`` (the grader's own exchanges), ``cases`` and ``labs`` (one call of the student's function
and its check), ``diagnose`` (hints), ``verdicts``, ``flops`` and ``work`` (counting products),
``timeline`` (overlap, trace), ``session`` (one file), ``job`` (one MPI job), ``batch`` (the
class: many files at many P), ``report`` (what is printed and written).
"""

import argparse
import importlib.util
import os
import sys

from .exercises import EXERCISES, select_terms, student_files

__all__ = ["EXERCISES", "check_options", "grade", "grade_class", "main", "parser"]

DEFAULT_TIMEOUT = 5.0  # seconds any one MPI call of the student's may block
DEFAULT_TIME_LIMIT = 120.0  # seconds one call of the student's function may take in all


class _Parser(argparse.ArgumentParser):
    """Prints usage and errors on rank 0 only."""

    rank = 0

    def _print_message(self, message, file=None):
        if self.rank == 0:
            super()._print_message(message, file)


def parser(rank=0):
    p = _Parser(prog="python -m mpiring.tools.grade", description=__doc__.splitlines()[0])
    p.rank = rank
    p.add_argument("students", nargs="+", metavar="FILE", help="students' .py files, or folders of them")
    p.add_argument("--exercise", choices=list(EXERCISES),
                   help="what to grade (default: the file's EXERCISE = \"...\", else forward: ring_attention, "
                        "causal and not); see docs/exercises.md and docs/course.md")
    p.add_argument("--quick", action="store_true", help="4 cases instead of the full matrix")
    p.add_argument("--cases", default="", metavar="TERMS",
                   help="only the cases that match: comma-separated sizes (tiny, small, medium, large), dtypes "
                        "(float64, float32), causal / non-causal")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds one MPI call may block before the code is declared stuck "
                        f"(default {DEFAULT_TIMEOUT:g})")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT,
                   help=f"seconds one call of the student's function may take; past it the job is aborted "
                        f"(default {DEFAULT_TIME_LIMIT:g})")
    p.add_argument("--ranks", metavar="P,P,...",
                   help="grade at each of these numbers of ranks, starting the MPI jobs (run it without mpiexec)")
    p.add_argument("--report", metavar="FILE", help="write the report as JSON (one entry per file and P)")
    p.add_argument("--csv", metavar="FILE", help="write the report as CSV (one row per file and P)")
    p.add_argument("--trace", metavar="FILE", help="write the student's timeline as a Chrome trace ({file}: the "
                                                   "student's file name; with several files or P it is added)")
    p.add_argument("--plot", metavar="FILE", help="draw the student's timeline (PNG; needs matplotlib)")
    p.add_argument("--verbose", action="store_true", help="with --ranks: show every job's full output")
    p.add_argument("--results", help=argparse.SUPPRESS)  # batch: where a job's rank 0 writes its records
    return p


def check_options(args):
    """The problem with the options (a message), or None; ``args.select`` is set from ``--cases``."""
    if not (args.timeout > 0 and args.time_limit > 0):
        return "--timeout and --time-limit must be positive"
    try:
        args.select = select_terms(args.cases)
    except ValueError as exc:
        return str(exc)
    missing = [p for p in args.students if not os.path.exists(p)]
    if missing:
        return f"no such file or folder: {', '.join(missing)}"
    if not student_files(args.students):
        return "no .py files to grade"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return "--plot needs matplotlib, which is not installed (leave out --plot, or use --trace)"
    return None


def grade(comm, argv):
    """Grade ``argv``'s files on every rank of ``comm``; returns the exit code, the same on every rank."""
    from .job import grade_job

    return grade_job(comm, argv)


def grade_class(argv):
    """``--ranks``: grade every file at every P, each P one MPI job started here; returns the exit code."""
    from .batch import grade_batch

    return grade_batch(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if any(a == "--ranks" or a.startswith("--ranks=") for a in argv):
        return grade_class(argv)
    from mpi4py import MPI

    return grade(MPI.COMM_WORLD, argv)
