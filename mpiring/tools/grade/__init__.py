"""Grade students' distributed attention (and the labs of docs/course.md): right answers, traffic, no unsafe MPI.

    mpiexec -n 4 python -m mpiring grade student.py
    mpiexec -n 4 python -m mpiring grade --exercise merge examples/exercises/01_merge.py
    python -m mpiring grade class/ --ranks 2,3,4 --report report.json     # starts the MPI jobs itself

docs/exercises.md says what is checked and how; docs/course.md how a class is graded. Under ``mpiexec -n P``
every file is graded at P in that job (``session``); with ``--ranks`` the grader runs outside MPI and
starts one job per P (``batch``). The options (``arguments``) use no MPI.
"""

from .arguments import DEFAULT_TIME_LIMIT, DEFAULT_TIMEOUT, check_options, parser
from .exercises import EXERCISES

__all__ = ["DEFAULT_TIME_LIMIT", "DEFAULT_TIMEOUT", "EXERCISES", "check_options", "grade", "grade_class",
           "grade_needs_mpi", "grade_parser", "parser"]


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
    from .session import grade_job

    return grade_job(comm, list(argv or []))


def grade_class(argv):
    """``--ranks``: grade every file at every P, each P one MPI job started here; returns the exit code."""
    from .batch import grade_batch

    return grade_batch(argv)
