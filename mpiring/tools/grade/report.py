"""What the grader prints and writes: lines per case, the summary table, a class's report as JSON and CSV.

No MPI here: the batch grader (``batch``) builds its report from the entries its jobs wrote.
An entry is one file graded at one P: ``file``, ``exercise``, ``P``, ``verdict`` ("pass" or
"fail"), ``checks`` (counts of passed, failed, not run, not judged), ``hints``, ``cases`` (every
check of every case, uncut), ``seconds``, ``aborted`` (why the job ended early, or None).
"""

import collections
import csv
import json

from ..cli import table_text

__all__ = ["CSV_FIELDS", "class_summary", "entry", "say", "show", "summary", "verdict_text", "write_csv", "write_json"]

CSV_FIELDS = ["file", "exercise", "P", "verdict", "passed", "failed", "not_run", "not_judged", "seconds", "aborted",
              "hints"]


def say(rank, text=""):
    if rank == 0:
        print(text, flush=True)


def show(rank, verdicts):
    for name, v in verdicts.items():
        for line in v.details:
            for part in line.splitlines():
                say(rank, f"      {name}: {part}" if not part.startswith("  ") else f"      {part}")
        for _, hint in v.hints:
            say(rank, f"      hint: {hint}")


def cell(v):
    """A check's cell: its status and short text, whole."""
    if v is None:
        return ""
    return v.status + ("  " + v.short if v.short and v.status != "not run" else "")


def counts(table):
    """(passed, failed, not run, not judged) over every check of the table."""
    c = collections.Counter(v.status for _, verdicts in table for v in verdicts.values())
    return c["ok"], c["FAIL"], c["not run"], c["not judged"]


def summary(rank, table, checks, P, seconds, hints, stopped=None):
    """The table of every case's checks, cells whole (columns as wide as their longest cell), and the verdict."""
    names = list(checks) + sorted({n for _, verdicts in table for n in verdicts} - set(checks))
    rows = [[label] + [cell(verdicts.get(c)) for c in names] for label, verdicts in table]
    say(rank, "")
    say(rank, f"summary: P = {P}, {seconds:.1f} s" + (f" (stopped: {stopped})" if stopped else ""))
    say(rank, table_text(["case"] + names, rows, left=True, indent="  "))
    passed, failed, not_run, unjudged = counts(table)
    total = passed + failed + not_run
    aside = f" ({unjudged} not judged)" if unjudged else ""
    if passed == total and not stopped:
        say(rank, f"PASS: all {total} checks passed{aside}")
    else:
        say(rank, f"FAIL: {passed} of {total} checks passed, {failed} failed, {not_run} not run{aside}")
        for hint in list(hints.values())[:4]:
            say(rank, f"  hint: {hint}")


def entry(path, exercise, P, table, hints, seconds, aborted=None, trace=None):
    """One file at one P, as the JSON report holds it."""
    passed, failed, not_run, unjudged = counts(table)
    ok = failed == 0 and not_run == 0 and not aborted
    return {"file": path, "exercise": exercise, "P": P, "verdict": "pass" if ok else "fail",
            "checks": {"passed": passed, "failed": failed, "not_run": not_run, "not_judged": unjudged},
            "hints": list(hints.values()), "seconds": round(seconds, 2), "aborted": aborted, "trace": trace,
            "cases": [{"case": label, "checks": {n: {"status": v.status, "short": v.short, "details": v.details}
                                                 for n, v in verdicts.items()}} for label, verdicts in table]}


def write_json(path, entries, meta):
    with open(path, "w") as f:
        json.dump(dict(meta, entries=entries), f, indent=1)


def write_csv(path, entries):
    with open(path, "w", newline="") as f:
        out = csv.DictWriter(f, CSV_FIELDS)
        out.writeheader()
        for e in entries:
            out.writerow({"file": e["file"], "exercise": e["exercise"], "P": e["P"], "verdict": e["verdict"],
                          **{k: e["checks"][k] for k in ("passed", "failed", "not_run", "not_judged")},
                          "seconds": e["seconds"], "aborted": e["aborted"] or "", "hints": " | ".join(e["hints"])})


def verdict_text(e):
    """"pass", "FAIL (2 failed, 0 not run)" or "FAIL (aborted, 1 passed, 11 not run)"."""
    c = e["checks"]
    if e["verdict"] == "pass":
        return "pass"
    if e["aborted"]:
        return f"FAIL (aborted, {c['passed']} passed, {c['not_run']} not run)"
    return f"FAIL ({c['failed']} failed, {c['not_run']} not run)"


def class_summary(entries, ranks, seconds):
    """Lines of the class's table: one row per file, a column per P, then the totals."""
    files = list(dict.fromkeys(e["file"] for e in entries))
    by = {(e["file"], e["P"]): e for e in entries}

    def mark(e):
        if e is None:
            return "-"
        return verdict_text(e)

    rows = [[f, by[(f, ranks[0])]["exercise"] if (f, ranks[0]) in by else ""] + [mark(by.get((f, P))) for P in ranks]
            for f in files]
    head = ["file", "exercise"] + [f"P={P}" for P in ranks]
    lines = ["", f"class summary: {len(files)} files x P = {', '.join(map(str, ranks))}, {seconds:.1f} s"]
    lines += table_text(head, rows, left=True, indent="  ").splitlines()
    passed = sum(e["verdict"] == "pass" for e in entries)
    lines.append(f"{passed} of {len(entries)} gradings passed")
    return lines
