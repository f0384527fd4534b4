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
``cli`` (the options), ``sync`` (the grader's own exchanges), ``cases`` and ``labs`` (one call of the student's function
and its check), ``diagnose`` (hints), ``verdicts``, ``flops`` and ``work`` (counting products),
``timeline`` (overlap, trace), ``session`` (one file), ``job`` (one MPI job), ``batch`` (the
class: many files at many P), ``report`` (what is printed and written).
"""

import sys

from .cli import check_options, parser
from .exercises import EXERCISES

__all__ = ["EXERCISES", "check_options", "grade", "grade_class", "main", "parser"]


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
