"""See the ring: Chrome trace JSON, a Gantt chart, a text timeline and a progress line.

The input is what ``distributed_attention`` gathers on root,
``schedule.records``: one dict per rank with ``rank``, ``t0`` and ``events``,
a list of ``(name, start, end, info)`` with ``time.perf_counter()`` stamps.
``t0`` is the rank's clock right after a barrier at the start of the ring, so
``start - t0`` puts every rank on one time base (to the barrier's exit skew,
a few microseconds on one machine). Event names:

- ``compute``: attention of the local queries to one K/V block; info has
  ``step``, ``source`` (rank the block came from), ``kind`` (full/masked), ``stream``;
- ``send``: the non-blocking send of the held block was posted; info has
  ``step``, ``stream``, ``dest`` and ``bytes`` (backward pass: ``data`` says what);
- ``wait``: blocked until this step's transfers completed; info has ``step``.

    mpiexec -n 4 python -m mpiring run --causal --trace trace.json --plot timeline.png

Open trace.json in https://ui.perfetto.dev or chrome://tracing. The plot needs
matplotlib: ``pip install 'mpiring[plot]'`` (or ``pip install matplotlib``).
"""

import json
import os
import sys
import time

__all__ = ["rank_events", "step_table", "chrome_trace", "write_chrome_trace", "format_timeline",
           "plot_timeline", "Progress", "stdout_is_terminal", "measured_steps", "timing_report", "plot_step_time"]

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


# ---------------------------------------------------------------- text and picture


def format_timeline(records, width=64):
    """A text Gantt chart: one row per rank, ``#`` compute, ``w`` waiting, ``.`` idle, ``|`` step end."""
    table = step_table(records)
    events = [rank_events(r) for r in records]
    end = max([e["end"] for ev in events for e in ev] + [1e-12])
    scale = width / end
    lines = []
    for record, ev, steps in zip(records, events, table):
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


def _need_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install 'mpiring[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(records, path, title=None, note=None):
    """Draw a Gantt chart of the ring to ``path`` (PNG, SVG, PDF: by extension).

    Top: per rank, compute bars labelled with the source block, waits in red,
    sends posted as small triangles, step ends as ticks, the rest idle.
    Bottom: per rank, total compute, blocked waiting and idle until the last
    rank finished, which is where causal imbalance shows.
    """
    plt = _need_matplotlib()
    table = step_table(records)
    events = [rank_events(r) for r in records]
    end = max([e["end"] for ev in events for e in ev] + [1e-12])
    ms = 1e3
    size = len(records)
    row = min(0.75, 12 / size)  # inches per rank: large rings get thinner rows
    height = 2.8 + 1.2 * row * size
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, height),
                                 gridspec_kw={"height_ratios": [3, 2]}, constrained_layout=True)
    colors = {"full": "#3b75af", "masked": "#8fb8de", "wait": "#d9534f", "idle": "#eeeeee"}
    for i, (record, ev, steps) in enumerate(zip(records, events, table)):
        y = size - 1 - i
        ax.barh(y, end * ms, left=0, height=0.7, color=colors["idle"], edgecolor="none")
        for e in ev:
            left, span = e["start"] * ms, (e["end"] - e["start"]) * ms
            if e["name"] == "compute":
                ax.barh(y, span, left=left, height=0.7, color=colors.get(e["kind"], colors["full"]),
                        edgecolor="white", linewidth=0.5)
                if span > 0.04 * end * ms and size <= 32:
                    ax.text(left + span / 2, y, str(e["source"]), ha="center", va="center", fontsize=8,
                            color="white" if e["kind"] == "full" else "black")
            elif e["name"] == "wait" and span > 0:
                ax.barh(y, span, left=left, height=0.7, color=colors["wait"], edgecolor="none")
            elif e["name"] == "send" and size <= 16:
                ax.plot([left], [y + 0.42], marker="v", color="black", markersize=4)
        for s in steps:
            if size <= 16:  # step ends; too busy to show for large rings
                ax.plot([s["end"] * ms] * 2, [y - 0.4, y + 0.4], color="black", linewidth=0.8)
    every = max(1, size // 16)  # label at most ~16 ranks
    ticks = [y for y in range(size) if (size - 1 - y) % every == 0]
    ax.set_yticks(ticks, [f"rank {size - 1 - y}" for y in ticks])
    ax.set_xlim(0, end * ms * 1.01)
    ax.set_xlabel("time since the start barrier (ms)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in ("full", "masked", "wait", "idle")]
    labels = ["compute (full block; number = source rank)", "compute (masked block)", "blocked in wait", "idle"]
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.63 / (0.55 * height)),
              ncol=4, fontsize=8, frameon=False)
    ax.set_title((title or "mpiring ring timeline") + (f"\n{note}" if note else ""), fontsize=10)

    compute = [sum(s["compute"] for s in steps) * ms for steps in table]
    wait = [sum(s["wait"] for s in steps) * ms for steps in table]
    idle = [end * ms - c - w for c, w in zip(compute, wait)]
    ys = [size - 1 - i for i in range(size)]
    bx.barh(ys, compute, color=colors["full"], label="compute")
    bx.barh(ys, wait, left=compute, color=colors["wait"], label="blocked in wait")
    bx.barh(ys, idle, left=[c + w for c, w in zip(compute, wait)], color="#bbbbbb", label="idle / finished early")
    for y, c in zip(ys, compute):
        if (size - 1 - y) % every == 0:
            bx.text(end * ms * 1.01, y, f"{100 * c / (end * ms):.0f}% busy", va="center", fontsize=8)
    bx.set_yticks(ticks, [f"rank {size - 1 - y}" for y in ticks])
    bx.set_xlim(0, end * ms * 1.15)
    bx.set_xlabel("total per rank until the last rank finished (ms)")
    bx.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.35 * height)), ncol=3, fontsize=8,
              frameon=False)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------------- progress


def stdout_is_terminal(stream=None):
    """True if output reaches a terminal, also through mpiexec (which pipes ranks' output).

    Under mpiexec a rank's stdout is a pipe to the launcher; on Linux the
    launcher's own stdout is looked up in /proc, so progress shows when the
    user runs mpiexec in a terminal and stays quiet when output is redirected.
    """
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    pid = os.getppid()
    for _ in range(4):  # rank -> proxy -> launcher
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if any(k in name for k in ("mpiexec", "mpirun", "prterun", "orterun", "srun")):
                return os.readlink(f"/proc/{pid}/fd/1").startswith(("/dev/pts/", "/dev/tty"))
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


class Progress:
    """A one-line step counter, redrawn at most every ``interval`` seconds.

    Pass it as ``on_step`` on rank 0: it costs a clock read per step. In a
    ring no rank gets more than a step ahead of its neighbour, so rank 0's
    count is the ring's. Quiet unless ``enabled`` (default: output is a terminal).
    """

    def __init__(self, label="ring step", enabled=None, stream=None, interval=0.2):
        self.stream = sys.stdout if stream is None else stream
        self.enabled = stdout_is_terminal(self.stream) if enabled is None else enabled
        self.label, self.interval = label, interval
        self.start = time.perf_counter()
        self._last = -float("inf")
        self._drawn = False

    def __call__(self, done, total):
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        self.stream.write(f"\r{self.label} {done}/{total}  {now - self.start:6.1f} s")
        self.stream.flush()
        self._drawn = True

    def close(self):
        """Erase the line so that the report starts clean."""
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False


# ---------------------------------------------------------------- prediction next to measurement


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
    from .costmodel import predict_plan

    pred = predict_plan(plan, machine, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                        itemsize=itemsize)
    meas = measured_steps(records)
    lines = [f"time model ({machine.name}: {machine.note})",
             "step  predicted: compute  transfer  max(c,t)  c+t (no overlap)  |  measured: step  compute  wait   (ms)"]
    for s, ((c, t, m), (d, mc, mw)) in enumerate(zip(pred, meas)):
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


def plot_step_time(path, *, seq_lens, devices, heads, head_dim, kv_heads=None, machines=("nvlink", "infiniband"),
                   variant="zigzag", causal=True, bytes_per_element=2):
    """Plot the time model's step time (compute, transfer, max) against the sequence length.

    One panel per machine; one line per device count in ``devices``. Dotted:
    transfer time per step, dashed: compute; a step costs the larger one.
    """
    import numpy as np

    from .costmodel import time_model

    plt = _need_matplotlib()
    fig, axes = plt.subplots(1, len(machines), figsize=(5.2 * len(machines), 4.2), squeeze=False,
                             constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for ax, machine in zip(axes[0], machines):
        for i, P in enumerate(devices):
            color = cmap(i / max(len(devices) - 1, 1))
            xs, comp, trans = [], [], []
            for S in seq_lens:
                if S < P:
                    continue
                r = time_model(int(S), P, heads=heads, head_dim=head_dim, kv_heads=kv_heads, machine=machine,
                               variant=variant, causal=causal, bytes_per_element=bytes_per_element)
                xs.append(S)
                comp.append(r["compute_s"][-1])
                trans.append(r["transfer_s"][0])
            if not xs:
                continue
            xs, comp, trans = np.array(xs), np.array(comp), np.array(trans)
            ax.loglog(xs, np.maximum(comp, trans), color=color, linewidth=2, label=f"P={P}")
            ax.loglog(xs, comp, color=color, linestyle="--", linewidth=0.8)
            ax.loglog(xs, trans, color=color, linestyle=":", linewidth=0.8)
            hide = time_model(max(int(xs[0]), P), P, heads=heads, head_dim=head_dim, kv_heads=kv_heads,
                              machine=machine, variant=variant, causal=causal,
                              bytes_per_element=bytes_per_element)["hide_above_tokens"]
            ax.axvline(hide * P, color=color, linewidth=0.5, alpha=0.6)
        ax.set_xlabel("total sequence length (tokens)")
        ax.set_ylabel("time per ring step (s)")
        ax.set_title(f"{machine}: {variant}{' causal' if causal else ''}, H={heads} H_kv={kv_heads or heads} "
                     f"d={head_dim}, {bytes_per_element} bytes/element", fontsize=9)
        ax.set_ylim(bottom=1e-6)
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].legend(fontsize=8, title="solid: step = max(compute, transfer)\ndashed: compute, dotted: transfer\n"
                      "thin vertical: P x tokens/device where\ntransfer hides", title_fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
