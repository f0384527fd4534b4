"""The teaching commands: grade students' code (one job, or a class at many P), and see a blocking ring deadlock.

    mpiexec -n 4 python -m mpiring grade student.py [--exercise NAME] [--quick]
    python -m mpiring grade class/ --ranks 2,3,4 --report report.json   # starts the MPI jobs itself
    mpiexec -n 2 python -m mpiring demo deadlock
"""

import argparse

__all__ = ["grade", "grade_needs_mpi", "grade_parser", "demo", "demo_parser"]


def grade_parser():
    """The grader's options (``mpiring.tools.grade``), under ``python -m mpiring grade``."""
    from .grade import parser

    p = parser(0)
    p.prog = "python -m mpiring grade"
    return p


def grade_needs_mpi(args):
    """With ``--ranks`` the grader starts the MPI jobs itself, and runs outside MPI."""
    return not grade_parser().parse_args(list(args or [])).ranks


def grade(comm, args=None):
    """Grade students' files on every rank of ``comm``, or (``comm`` None, ``--ranks``) a class at several P.

    The same exit code everywhere: 0 when every check passed."""
    from .grade import grade as run_grade
    from .grade import grade_class

    return grade_class(list(args or [])) if comm is None else run_grade(comm, list(args or []))


DEMOS = {"deadlock": "a ring of blocking Sends: fine below MPI's eager limit, deadlocked above; the two fixes"}


def demo_parser():
    p = argparse.ArgumentParser(prog="python -m mpiring demo", description="Demonstrations that run under mpiexec.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="demos:\n" + "".join(f"  {name:<10}{what}\n" for name, what in DEMOS.items()))
    p.add_argument("name", choices=list(DEMOS), help="which demo")
    p.add_argument("options", nargs=argparse.REMAINDER, help="the demo's options (--help lists them)")
    return p


def demo(comm, args=None):
    """Run a demo on every rank of ``comm``."""
    from .deadlock import deadlock_demo

    options = demo_parser().parse_args(list(args or []))
    return {"deadlock": deadlock_demo}[options.name](comm, options.options)
