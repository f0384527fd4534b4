"""A run's events per rank and per step: as a Chrome trace (JSON for https://ui.perfetto.dev or
chrome://tracing), a text timeline, and against the time model's step times.

    mpiexec -n 4 python -m mpiring run --causal --trace trace.json

The input is what the ranks recorded (``Record.summary()``: ``rank``, ``t0``, ``events``, each event
``(name, start, end, info)`` in ``time.perf_counter()`` seconds, ``t0`` the rank's clock after a start
barrier): ``compute`` (info: step, source, kind, stream), ``send`` (step, stream, dest, bytes; backward:
``data``) and ``wait`` (step).
"""

import json

from mpiring.cost.costmodel import predict_plan

__all__ = ["rank_events", "step_table", "chrome_trace", "write_chrome_trace", "format_timeline", "measured_steps",
           "timing_report"]

COMPUTE_TID, COMM_TID, STEP_TID = 0, 1, 2


def rank_events(record):
    """The rank's events as dicts with times in seconds since its start barrier.

    Sends posted together (two streams in one ``shift``) share one interval;
    it is split between them so that no two events of a row overlap.
    """
    t0 = record.get("t0", 0.0)
    events = [dict(info, name=name, start=start - t0, end=end - t0) for name, start, end, info in record["events"]]
    groups = {}
    for e in events:
        if e["name"] == "send":
            groups.setdefault(e["start"], []).append(e)
    for start, group in groups.items():
        width = (max(e["end"] for e in group) - start) / len(group)
        for i, e in enumerate(group):
            e["start"], e["end"] = start + i * width, start + (i + 1) * width
    return events


def step_table(records):
    """Per rank, per step: ``start``, ``end``, ``compute``, ``wait`` and ``idle`` seconds.

    A rank's step starts when its previous step ended (step 0 at the start
    barrier) and ends with the last event of that step (the wait, in a ring).
    ``idle`` is the rest: neither computing nor blocked in a wait (posting
    sends, merging bookkeeping, the Python loop). Returns ``rows[rank][step]``.
    """
    rows = []
    for record in records:
        by_step = {}
        for e in rank_events(record):
            if e.get("step") is not None:
                by_step.setdefault(e["step"], []).append(e)
        steps, prev_end = [], 0.0
        for s in range(1 + max(by_step, default=-1)):
            mine = by_step.get(s, [])
            end = max([e["end"] for e in mine] + [prev_end])
            compute = sum(e["end"] - e["start"] for e in mine if e["name"] == "compute")
            wait = sum(e["end"] - e["start"] for e in mine if e["name"] == "wait")
            steps.append(dict(step=s, start=prev_end, end=end, compute=compute, wait=wait,
                              idle=max(0.0, end - prev_end - compute - wait)))
            prev_end = end
        rows.append(steps)
    return rows


# ---------------------------------------------------------------- Chrome trace events


def _us(seconds):
    return round(seconds * 1e6, 3)


def _span(start, end):
    """``ts`` and ``dur`` in microseconds, rounded so that ts + dur is the rounded end:
    an event that ends where the next begins never appears to overlap it."""
    ts = _us(start)
    return {"ts": ts, "dur": round(_us(end) - ts, 3)}


def chrome_trace(records, title="mpiring", meta=None):
    """The events as a Chrome trace-event dict (``{"traceEvents": [...]}``).

    One process per rank; thread 0 is compute, thread 1 communication (sends
    posted, waits), thread 2 the ring steps. Arrows (flow events) join each
    send to the wait on the receiving rank that completes it.
    """
    out = []
    waits = {}  # (rank, step, data) -> wait event, to end the flow arrows
    for record in records:
        r = record["rank"]
        out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"rank {r}"}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
        for tid, name in ((COMPUTE_TID, "compute"), (COMM_TID, "communication"), (STEP_TID, "ring steps")):
            out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": name}})
            out.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
        for e in rank_events(record):
            args = {k: v for k, v in e.items() if k not in ("name", "start", "end")}
            base = {"ph": "X", "pid": r, **_span(e["start"], e["end"]), "args": args}
            if e["name"] == "compute":
                out.append(dict(base, name=f"block {e['source']} ({e['kind']})", cat="compute", tid=COMPUTE_TID))
            elif e["name"] == "send":
                what = f"send {e['data']}" if e.get("data") else "send"
                what += f" ({e['link']})" if e.get("link") else ""  # double ring: inside a node or between nodes
                out.append(dict(base, name=f"{what} -> {e['dest']}", cat="comm", tid=COMM_TID))
            elif e["name"] == "wait":
                out.append(dict(base, name=f"wait {e['data']}" if e.get("data") else "wait", cat="comm",
                                tid=COMM_TID))
                waits[(r, e["step"], e.get("data"))] = e
                waits.setdefault((r, e["step"], None), e)
            else:
                out.append(dict(base, name=e["name"], cat="other", tid=COMM_TID))
        for s in step_table([record])[0]:
            out.append({"ph": "X", "pid": r, "tid": STEP_TID, "name": f"step {s['step']}", "cat": "step",
                        **_span(s["start"], s["end"]),
                        "args": {k: round(s[k] * 1e3, 4) for k in ("compute", "wait", "idle")} | {"unit": "ms"}})
    flow = 0
    for record in records:
        for e in rank_events(record):
            target = _completing_wait(waits, e) if e["name"] == "send" else None
            if target is None:
                continue
            flow += 1
            common = {"name": e.get("data") or "K/V", "cat": "transfer", "id": flow, "tid": COMM_TID}
            out.append(dict(common, ph="s", pid=record["rank"], ts=_us(e["start"])))
            out.append(dict(common, ph="f", bp="e", pid=e["dest"], ts=_us(target["start"])))
    other = {"title": title, "time_base": "perf_counter seconds since each rank's start barrier, in microseconds"}
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other | (meta or {})}


def _completing_wait(waits, send):
    """The receiver's wait that completes ``send``: K/V the same step, a dK/dV partial the next one
    (backward pass), a partial going home the final wait; unlabelled waits (forward pass) match any."""
    dest, step, data = send.get("dest"), send.get("step"), send.get("data")
    if data == "dK/dV":
        step += 1
    elif data == "dK/dV home":
        step = max((s for (r, s, d) in waits if r == dest and d == data), default=None)
    return waits.get((dest, step, data)) or waits.get((dest, step, None))


def write_chrome_trace(path, records, title="mpiring", meta=None):
    """Write ``chrome_trace(records)`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(chrome_trace(records, title, meta), f, default=str)
    return path


# ---------------------------------------------------------------- in text


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
