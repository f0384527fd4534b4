"""One MPI job of the grader: every file given, at the job's number of ranks, one after another (``grade_job``),
each file's cases, then the counted call (``grade_file``).

Every rank runs every case and computes the same verdicts (from everything every rank saw); rank 0 prints.
After the case matrix, exercises that ask for it get one more call with counting arrays: the work checks
(causal skipping, zigzag balance) and the overlap check, from the strict communicator's timeline, which also
gives the student's trace and plot (``--trace``/``--plot``). With ``--results`` (the batch grader's) rank 0
writes a JSON line per event (start, case, end, abort), so a job that ends early still says what it graded.
"""

import json
import os
import time
from dataclasses import dataclass

from ...testing.timed import size_text
from .arguments import check_options, parser
from .cases import load_student, run_backward_case, run_forward_case, run_merge_case
from .exercises import EXERCISES, declared_exercise, make_cases, student_files
from .labs import run_allreduce_case, run_decode_case, run_passq_case
from .report import class_summary, entry, say, show, summary, write_csv, write_json
from .sync import Lost, allgather, fatal
from .timeline import overlap_verdict, records
from .verdicts import Verdict, output_verdict, safety_verdict, traffic_verdict
from .work import counted_runs, measure_work, work_verdict

__all__ = ["Options", "grade_file", "grade_job"]

RUNNERS = {"merge": lambda case, ex, fn, comm, opts, events: run_merge_case(case, fn, comm, opts, events),
           "backward": run_backward_case, "forward": run_forward_case, "passq": run_passq_case,
           "decode": run_decode_case, "allreduce": run_allreduce_case}


def _label(case, exercise):
    if exercise.kind in ("forward", "backward", "passq"):
        return f"{case.label} ({size_text(case.message)}/msg)"
    return case.label


def grade_file(gcomm, exercise, opts, sink=None):
    """Grade ``opts.path`` as ``exercise`` on every rank of ``gcomm``; returns (entry, clean).

    ``sink(record)``: rank 0 hands it a record after each case ("case") and at the end ("end"),
    so a job aborted by ``--time-limit`` still leaves what was graded. ``clean`` is False when a
    collective of the student's was left unfinished (the job must then end).
    """
    result, clean = _grade_file(gcomm, exercise, opts, sink)
    if gcomm.Get_rank() == 0 and sink:
        sink({"event": "end", "file": opts.name, "entry": result})
    return result, clean


def _grade_file(gcomm, exercise, opts, sink):
    rank, P = gcomm.Get_rank(), gcomm.Get_size()
    name = opts.name
    start = time.perf_counter()
    try:
        fn, problem = load_student(opts.path, exercise.function), None
    except Exception as exc:  # noqa: BLE001  reported, then every rank fails this file
        fn, problem = None, f"cannot load {name}: {type(exc).__name__}: {exc}"
    problems = [p for p in allgather(gcomm, problem, opts.sync_timeout, "loading the student's file") if p]
    if problems:
        say(rank, f"grade: {problems[0]}")
        say(rank, f"it must define {exercise.signature}")
        load = Verdict("FAIL", "cannot load", [problems[0]], [("load", f"it must define {exercise.signature}")])
        return entry(name, exercise.name, P, [("loading the file", {"safety": load})], {"load": load.hints[0][1]},
                     time.perf_counter() - start), True
    cases = make_cases(exercise, P, opts.quick, opts.select)
    checks = ("output", "safety") if exercise.traffic == "none" else ("output", "traffic", "safety")
    say(rank, f"grading {name}: {exercise.name} ({exercise.title}), P = {P}, {len(cases)} cases, "
              f"timeout {opts.timeout:g} s")
    say(rank, f"  {exercise.signature}")
    table, hints, clean, stopped = [], {}, True, None
    trace_runs, current = None, ["the counted call"]
    labels = [_label(case, exercise) for case in cases]

    def last_words(why):  # the watchdog's, before it aborts the job: the summary so far, from this rank
        left = labels[labels.index(current[0]):] if current[0] in labels else [current[0]]
        partial = table + [(label, {n: Verdict("not run") for n in checks}) for label in left]
        summary(0, partial, checks, P, time.perf_counter() - start, hints, stopped=f"aborted: {why}")
        if sink:
            sink({"event": "abort", "file": name, "why": why,
                  "entry": entry(name, exercise.name, P, partial, hints, time.perf_counter() - start, why)})

    opts.last_words = last_words
    for i, case in enumerate(cases):
        label = current[0] = labels[i]
        run, check = RUNNERS[exercise.kind](case, exercise, fn, gcomm, opts, events=bool(opts.trace or opts.plot))
        everyone = allgather(gcomm, (run, check), opts.sync_timeout)
        runs = [r for r, _ in everyone]
        safety = safety_verdict(runs)
        verdicts = {"output": output_verdict([c for _, c in everyone]) if safety.status == "ok"
                    or all(r.outcome == "returned" for r in runs) else Verdict("not run")}
        if "traffic" in checks:
            verdicts["traffic"] = traffic_verdict(case, exercise, runs)
        verdicts["safety"] = safety
        table.append((label, verdicts))
        if all(r.outcome == "returned" for r in runs):
            trace_runs = runs
        line = " | ".join(f"{n} {v.status}" + (f" ({v.short})" if v.short and v.status != "not run" else "")
                          for n, v in verdicts.items())
        say(rank, f"[{i + 1:2d}/{len(cases)}] {label}: {line}")
        _shown(rank, verdicts, hints)
        clean = all(r.clean for r in runs)
        if rank == 0 and sink:
            sink({"event": "case", "file": name, "case": label})
        if any(r.outcome != "returned" for r in runs):
            for later in cases[i + 1:]:
                table.append((_label(later, exercise), {n: Verdict("not run") for n in checks}))
            say(rank, f"stopped: the remaining {len(cases) - i - 1} cases are not run")
            stopped = "a rank raised or got stuck"
            break
        if not clean:
            break
    if clean and exercise.kind == "forward" and (exercise.work or exercise.overlap):
        current[0] = "the counted call"
        counted = None if stopped else counted_runs(exercise, fn, gcomm, opts, causal=bool(exercise.work))
        for title, verdict in _counted_verdicts(exercise, counted, P):
            table.append((title, {"output": verdict}))
            say(rank, f"{title}: {verdict.status}" + (f" ({verdict.short})" if verdict.short else ""))
            _shown(rank, {title.split(":")[0]: verdict}, hints)
        if counted and all(r.outcome == "returned" for r in counted[1]):
            trace_runs = counted[1]
    seconds = time.perf_counter() - start
    summary(rank, table, checks, P, seconds, hints)
    traced = _write_timeline(rank, opts, trace_runs, f"{name}: {exercise.name}, P={P}")
    return entry(name, exercise.name, P, table, hints, seconds, trace=traced), clean


def _shown(rank, verdicts, hints):
    """Rank 0 prints the verdicts' details and hints; the first hint of each kind is kept in ``hints``."""
    show(rank, verdicts)
    for v in verdicts.values():
        for kind, text in v.hints:
            hints.setdefault(kind, text)


def _counted_verdicts(exercise, counted, P):
    """``[(title, verdict)]`` of the checks the counted call answers: the work, the overlap."""
    extra = []
    if exercise.work:
        title = "work: causal skipping" if exercise.work == "skip" else "work: zigzag balance"
        extra.append((title, work_verdict(exercise, counted and measure_work(exercise, *counted, P))))
    if exercise.overlap:
        extra.append(("overlap: sends during compute", overlap_verdict(counted and counted[1])))
    return extra


def _write_timeline(rank, opts, runs, title):
    """``--trace``/``--plot``: the student's timeline of the last call every rank returned from (rank 0)."""
    if rank != 0 or not (opts.trace or opts.plot) or runs is None:
        return None
    from ..plot import plot_timeline
    from ..trace import write_chrome_trace

    stem = os.path.splitext(os.path.basename(opts.path))[0]
    written = []
    draw = {"trace": lambda rec, path: write_chrome_trace(path, rec, title=title),
            "plot": lambda rec, path: plot_timeline(rec, path, title=title)}
    for kind, path in (("trace", opts.trace), ("plot", opts.plot)):
        if path:
            target = path.replace("{file}", stem)
            draw[kind](records(runs), target)
            say(rank, f"timeline written to {target}")
            written.append(target)
    return written[0] if written else None


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
