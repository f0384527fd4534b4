"""One MPI job of the grader: every file given, at the job's number of ranks, one after another.

Rank 0 prints; with ``--results`` (the batch grader's) it also writes a JSON line per event
(start, case, end, abort) as it goes, so a job that ends early still says what it graded.
"""

import json
import os
from dataclasses import dataclass

from .arguments import check_options, parser
from .exercises import EXERCISES, declared_exercise, student_files
from .report import class_summary, say, write_csv, write_json
from .session import grade_file
from .sync import Lost, fatal

__all__ = ["Options", "grade_job"]


@dataclass
class Options:
    path: str  # absolute
    name: str  # as given
    timeout: float
    time_limit: float
    quick: bool = False
    select: dict | None = None
    trace: str | None = None
    plot: str | None = None
    last_words: object = None

    @property
    def sync_timeout(self):
        """How long the grader waits for the other ranks: longer than any student call may take."""
        return self.time_limit + 2 * self.timeout + 30


def _sink(path):
    def write(record):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    return write


def _per_file(path, many):
    """A --trace/--plot path for one of many files: {file} in it, or added before the extension."""
    if path is None or "{file}" in path or not many:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}-{{file}}{ext}"


def grade_job(comm, argv):
    """Grade ``argv``'s files on every rank of ``comm``; returns the exit code, the same on every rank."""
    import time

    rank, P = comm.Get_rank(), comm.Get_size()
    try:
        args = parser(rank).parse_args(argv)
    except SystemExit as exc:
        return exc.code
    problem = "--ranks starts MPI jobs itself: run it without mpiexec" if args.ranks else check_options(args)
    if problem:
        say(rank, f"grade: {problem}")
        return 2
    files = student_files(args.students)
    sink = _sink(args.results) if rank == 0 and args.results else None
    entries, start = [], time.perf_counter()
    gcomm = comm.Dup()
    try:
        for path in files:
            exercise = EXERCISES[args.exercise or declared_exercise(path) or "forward"]
            opts = Options(os.path.abspath(path), path, args.timeout, args.time_limit, args.quick, args.select,
                           _per_file(args.trace, len(files) > 1), _per_file(args.plot, len(files) > 1))
            if sink:
                sink({"event": "start", "file": path, "exercise": exercise.name, "P": P})
            result, clean = grade_file(gcomm, exercise, opts, sink)
            entries.append(result)
            if not clean:  # a collective of the student's could not be cleaned up: end the job the hard way
                fatal(comm, "the student's code left an MPI collective unfinished", code=1)
            say(rank, "")
    except Lost as exc:
        fatal(comm, str(exc))
    gcomm.Free()
    if len(files) > 1:
        for line in class_summary(entries, [P], time.perf_counter() - start):
            say(rank, line)
    if rank == 0 and args.report:
        write_json(args.report, entries, {"ranks": [P]})
    if rank == 0 and args.csv:
        write_csv(args.csv, entries)
    return 0 if all(e["verdict"] == "pass" for e in entries) else 1
