"""Grading a class: every file at every P, one MPI job per P started here, into one report. No MPI here.

    python -m mpiring grade class/ --ranks 2,3,4 --report report.json --csv report.csv

Each job (``mpiexec -n P python -m mpiring grade ... FILES``) grades all the files; its rank
0 writes a JSON line per case and per file. A file that makes the job end early (``--time-limit``,
an unfinished collective) gets a "fail" entry saying why, with the checks done so far, and a new
job grades the files after it. The class summary and the report are written whatever happened.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .arguments import check_options, parser
from .exercises import EXERCISES, declared_exercise, make_cases, student_files
from .report import class_summary, verdict_text, write_csv, write_json

__all__ = ["grade_batch", "launcher", "parse_ranks"]

LAUNCH_VARIABLES = ("PMI_RANK", "PMI_FD", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")


def parse_ranks(text):
    """``"2,3,4"`` as [2, 3, 4]; ValueError unless positive integers."""
    try:
        ranks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 1:
        raise ValueError(f"--ranks must be positive integers like 2,3,4, not {text!r}")
    return list(dict.fromkeys(ranks))


def launcher():
    """(mpiexec argv prefix, environment) for a job of our own: the launch variables of a parent job removed."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise ValueError("no mpiexec on PATH: --ranks starts MPI jobs with it")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_",
                                                                   "OMPI_COMM_WORLD_", "MPI_LOCAL"))}
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=60)
    if "open mpi" in (version.stdout + version.stderr).lower() or "openrte" in version.stdout.lower():
        if os.geteuid() == 0:
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return [mpiexec, "--oversubscribe"], env
    return [mpiexec], env


def _passed_on(args, P, many_ranks, many_files):
    """The options a job gets (the report's are written here); --trace/--plot paths named per file and P."""
    out = ["--timeout", str(args.timeout), "--time-limit", str(args.time_limit)]
    out += ["--exercise", args.exercise] if args.exercise else []
    out += ["--quick"] if args.quick else []
    out += ["--cases", args.cases] if args.cases else []
    for flag, path in (("--trace", args.trace), ("--plot", args.plot)):
        if path:
            stem, ext = os.path.splitext(path)
            stem += "-{file}" if many_files and "{file}" not in path else ""
            stem += "-P{P}" if many_ranks and "{P}" not in path else ""
            out += [flag, (stem + ext).replace("{P}", str(P))]
    return out


def _records(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return []


def _why(output, limit):
    lines = [ln.strip() for ln in output.splitlines() if ln.startswith("grade: rank") and "abort" in ln]
    if lines:
        return lines[0]
    last = (output.strip().splitlines() or ["no output"])[-1]
    return f"the job was killed after {limit:g} s" if limit else f"the job ended early: {last}"


def _aborted(path, P, records, why, args):
    """The entry of the file the job was grading when it ended."""
    for r in records:
        if r["event"] == "abort" and r["file"] == path:
            e = r["entry"]
            e["aborted"], e["hints"] = why, [why] + e["hints"]
            return e
    exercise = args.exercise or declared_exercise(path) or "forward"
    done = [r["case"] for r in records if r["event"] == "case" and r["file"] == path]
    cases = [{"case": c, "checks": {"note": {"status": "graded", "short": "", "details": [
        "the job ended before this file's summary: see the job's output"]}}} for c in done]
    left = len(make_cases(EXERCISES[exercise], P, args.quick, args.select)) - len(done)
    return {"file": path, "exercise": exercise, "P": P, "verdict": "fail",
            "checks": {"passed": 0, "failed": 1, "not_run": max(left, 0), "not_judged": 0},
            "hints": [why], "seconds": None, "aborted": why, "trace": None, "cases": cases}


def _line(e):
    hint = f"; hint: {e['hints'][0]}" if e["verdict"] != "pass" and e["hints"] else ""
    return f"P={e['P']} {e['file']} ({e['exercise']}): {verdict_text(e)}{hint}"


def grade_batch(argv):
    """Grade every file of ``argv`` at every P of ``--ranks``; prints the class summary; returns the exit code."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code
    try:
        if any(os.environ.get(v) for v in LAUNCH_VARIABLES):
            raise ValueError("--ranks starts the MPI jobs itself: run it without mpiexec")
        ranks = parse_ranks(args.ranks)
        problem = check_options(args)
        if problem:
            raise ValueError(problem)
        prefix, env = launcher()
    except ValueError as exc:
        print(f"grade: {exc}", file=sys.stderr)
        return 2
    files = student_files(args.students)
    entries, start = [], time.perf_counter()
    limit = 300 + 25 * (args.time_limit + 2 * args.timeout)  # per file: a net under the jobs' own limits
    with tempfile.TemporaryDirectory(prefix="mpiring-grade-") as scratch:
        for P in ranks:
            todo = list(files)
            while todo:
                results = os.path.join(scratch, f"P{P}-{len(entries)}.jsonl")
                cmd = prefix + ["-n", str(P), sys.executable, "-m", "mpiring", "grade",
                                *_passed_on(args, P, len(ranks) > 1, len(files) > 1), "--results", results, *todo]
                output, killed = _run(cmd, env, limit * len(todo), args.verbose)
                records = _records(results)
                ended = {r["file"]: r["entry"] for r in records if r["event"] == "end"}
                started = [r["file"] for r in records if r["event"] == "start"]
                cut = next((f for f in started if f not in ended), None)  # the file the job ended in
                for path in todo:
                    if path in ended:
                        entries.append(ended[path])
                    elif path == cut or not started:
                        entries.append(_aborted(path, P, records, _why(output, killed), args))
                    else:
                        continue
                    print(_line(entries[-1]), flush=True)
                if not started:
                    break
                todo = [f for f in todo if f not in ended and f != cut]  # the files after the one it ended in
    seconds = time.perf_counter() - start
    for line in class_summary(entries, ranks, seconds):
        print(line)
    meta = {"ranks": ranks, "files": files, "seconds": round(seconds, 1)}
    if args.report:
        write_json(args.report, entries, meta)
        print(f"report written to {args.report}")
    if args.csv:
        write_csv(args.csv, entries)
        print(f"CSV written to {args.csv}")
    return 0 if entries and all(e["verdict"] == "pass" for e in entries) else 1


def _run(cmd, env, limit, verbose):
    """(stdout + stderr, None or the limit it was killed at) of a job; its whole process group ends with it."""
    import signal

    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=limit)
        killed = None
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        killed = limit
    if verbose:
        print(output, flush=True)
    return output, killed
