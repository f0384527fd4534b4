"""What rank 0 prints: a line per check of a case, its details and hints, and the summary table."""

import collections

__all__ = ["say", "show", "summary"]


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


def summary(rank, table, checks, P, seconds, hints):
    width = max(len(label) for label, _ in table) + 2
    say(rank, "")
    say(rank, f"summary: P = {P}, {seconds:.1f} s")
    say(rank, "  " + "case".ljust(width) + "".join(c.ljust(34) for c in checks).rstrip())
    counts = collections.Counter()
    for label, verdicts in table:
        cells = []
        for c in checks:
            v = verdicts.get(c)
            if v is None:
                cells.append("")
                continue
            counts[v.status] += 1
            cells.append((v.status + ("  " + v.short if v.short and v.status != "not run" else ""))[:32].ljust(34))
        say(rank, "  " + label.ljust(width) + "".join(cells).rstrip())
    unjudged = counts.pop("not judged", 0)  # a check that could not be made: neither passed nor failed
    total = sum(counts.values())
    aside = f" ({unjudged} not judged)" if unjudged else ""
    if counts["ok"] == total:
        say(rank, f"PASS: all {total} checks passed{aside}")
    else:
        say(rank, f"FAIL: {counts['ok']} of {total} checks passed, {counts['FAIL']} failed, "
                   f"{counts['not run']} not run{aside}")
        for hint in list(hints.values())[:4]:
            say(rank, f"  hint: {hint}")
