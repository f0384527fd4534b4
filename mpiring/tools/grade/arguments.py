"""The grader's command line: its options and their checks (no MPI, so the batch grader can use them)."""

import argparse
import importlib.util
import os

from .exercises import EXERCISES, select_terms, student_files

__all__ = ["DEFAULT_TIME_LIMIT", "DEFAULT_TIMEOUT", "check_options", "parser"]

DESCRIPTION = "Grade students' distributed attention (docs/exercises.md, docs/course.md)."
DEFAULT_TIMEOUT = 5.0  # seconds any one MPI call of the student's may block
DEFAULT_TIME_LIMIT = 120.0  # seconds one call of the student's function may take in all


class _Parser(argparse.ArgumentParser):
    """Prints usage and errors on rank 0 only."""

    rank = 0

    def _print_message(self, message, file=None):
        if self.rank == 0:
            super()._print_message(message, file)


def parser(rank=0):
    p = _Parser(prog="python -m mpiring grade", description=DESCRIPTION)
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


