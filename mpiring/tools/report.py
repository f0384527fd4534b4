"""A run in text: the timeline of every rank, and the time model's step times next to the measured ones."""

from mpiring.cost.costmodel import predict_plan

from .trace import rank_events, step_table

__all__ = ["format_timeline", "measured_steps", "timing_report"]


def format_timeline(records, width=64):
    """A text Gantt chart: one row per rank, ``#`` compute, ``w`` waiting, ``.`` idle, ``|`` step end."""
    table = step_table(records)
    events = [rank_events(r) for r in records]
    end = max([e["end"] for ev in events for e in ev] + [1e-12])
    scale = width / end
    lines = []
    for record, ev, steps in zip(records, events, table, strict=True):
        row = ["."] * width
        for e in ev:
            mark = {"compute": "#", "wait": "w"}.get(e["name"])
            if mark is None:
                continue
            a, b = int(e["start"] * scale), int(e["end"] * scale)
            for i in range(a, max(a + 1, b) if mark == "#" else b):
                row[min(i, width - 1)] = mark
        for s in steps:
            i = min(int(s["end"] * scale), width - 1)
            if row[i] != "#":
                row[i] = "|"
        busy = sum(s["compute"] for s in steps)
        lines.append(f"rank {record['rank']:>2} {''.join(row)} compute {100 * busy / end:3.0f}%")
    lines.append(f"{'':8}0{'':>{width - 12}}{end * 1e3:10.2f} ms")
    lines.append(f"{'':8}# compute  w blocked in wait  . idle  | end of a ring step")
    return "\n".join(lines)


def measured_steps(records):
    """Per step: ``(slowest rank's step, busiest rank's compute, longest wait)`` in seconds.

    The ring couples ranks only through their neighbours, so ranks are not in
    lockstep; the slowest rank's duration of a step is what the time model's
    ``max(compute, transfer)`` over ranks predicts.
    """
    table = step_table(records)
    n_steps = max(len(rows) for rows in table)
    out = []
    for s in range(n_steps):
        rows = [rows[s] for rows in table if s < len(rows)]
        out.append((max(r["end"] - r["start"] for r in rows), max(r["compute"] for r in rows),
                    max(r["wait"] for r in rows)))
    return out


def timing_report(records, plan, machine, *, batch, heads, kv_heads, head_dim, itemsize, ranks_per_core=None):
    """Text table: predicted (time model with ``machine``) and measured time of every ring step."""
    pred = predict_plan(plan, machine, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        itemsize=itemsize)
    meas = measured_steps(records)
    lines = [f"time model ({machine.name}: {machine.note})",
             "step  predicted: compute  transfer  max(c,t)  c+t (no overlap)  |  measured: step  compute  wait   (ms)"]
    for s, ((c, t, m), (d, mc, mw)) in enumerate(zip(pred, meas, strict=False)):
        lines.append(f"{s:>4}  {c * 1e3:>18.3f}  {t * 1e3:>8.3f}  {m * 1e3:>8.3f}  {(c + t) * 1e3:>16.3f}  |  "
                     f"{d * 1e3:>14.3f}  {mc * 1e3:>7.3f}  {mw * 1e3:>5.3f}")
    total_pred = sum(m for _, _, m in pred)
    total_serial = sum(c + t for c, t, _ in pred)
    total_meas = max(max(s["end"] for s in rows) for rows in step_table(records) if rows)
    lines.append(f"total {'':>17}{'':>10}  {total_pred * 1e3:>8.3f}  {total_serial * 1e3:>16.3f}  |  "
                 f"{total_meas * 1e3:>14.3f}  (start barrier to the last rank's end)")
    lines.append(f"mean step: predicted {total_pred / len(pred) * 1e3:.3f} ms (overlapped) to "
                 f"{total_serial / len(pred) * 1e3:.3f} ms (serial), measured "
                 f"{sum(d for d, _, _ in meas) / len(meas) * 1e3:.3f} ms (slowest rank's steps)")
    if ranks_per_core is not None and ranks_per_core > 1:
        lines.append(f"note: {ranks_per_core:.1f} ranks per core: ranks share cores, so these timings are not "
                     f"meaningful (the calibration measured the shared rate)")
    return "\n".join(lines)
