"""Grade students' distributed attention (and the labs of docs/course.md): right answers, traffic, no unsafe MPI.

    mpiexec -n 4 python -m mpiring grade student.py
    mpiexec -n 4 python -m mpiring grade --exercise merge examples/exercises/01_merge.py
    python -m mpiring grade class/ --ranks 2,3,4 --report report.json     # starts the MPI jobs itself

docs/exercises.md says what is checked (output, traffic, safety, work, overlap) and how; docs/course.md how
a class is graded. Under ``mpiexec -n P`` every file is graded at P in that job (``job``, ``session``); with
``--ranks`` the grader runs outside MPI and starts one job per P (``batch``). The student's ``comm`` is
``mpiring.testing``'s strict communicator (``wire``).

The package: ``exercises`` (the labs and their cases), ``cli`` (the options), ``sync`` (the grader's own
exchanges), ``cases`` and ``labs`` (one call of the student's function and its check), ``diagnose`` (hints),
``verdicts``, ``flops`` and ``work`` (counting products), ``timeline`` (overlap, trace), ``report``.
"""

import sys

from ..cli import launch_rank
from .arguments import check_options, parser
from .exercises import EXERCISES

__all__ = ["EXERCISES", "check_options", "grade", "grade_class", "grade_needs_mpi", "grade_parser", "main", "parser"]


def grade_parser():
    return parser(0)


def grade_needs_mpi(args):
    """With ``--ranks`` the grader starts the MPI jobs itself, and runs outside MPI."""
    return not grade_parser().parse_args(list(args or [])).ranks


def grade(comm, argv=None):
    """Grade ``argv``'s files on every rank of ``comm``, or (``comm`` None, ``--ranks``) a class at several P;
    returns the exit code, the same on every rank."""
    if comm is None:
        return grade_class(list(argv or []))
    from .job import grade_job

    return grade_job(comm, list(argv or []))


def grade_class(argv):
    """``--ranks``: grade every file at every P, each P one MPI job started here; returns the exit code."""
    from .batch import grade_batch

    return grade_batch(argv)


def main(argv=None):
    """``python -m mpiring.tools.grade``, the earlier spelling of ``python -m mpiring grade``."""
    argv = sys.argv[1:] if argv is None else argv
    if launch_rank() == 0:
        print("python -m mpiring.tools.grade is deprecated: use python -m mpiring grade", file=sys.stderr)
    if any(a == "--ranks" or a.startswith("--ranks=") for a in argv):
        return grade_class(argv)
    from mpi4py import MPI

    return grade(MPI.COMM_WORLD, argv)
