"""Pictures of the ring (a Gantt chart of a run) and of the time model (step time against sequence length).

    mpiexec -n 4 python -m mpiring run --causal --plot timeline.png

Needs matplotlib: ``pip install -e ".[plot]"`` in the checkout (or ``pip install matplotlib``).
"""

import numpy as np

from mpiring.cost.costmodel import time_model

from .trace import rank_events, step_table

__all__ = ["plot_timeline", "plot_step_time"]


def _need_matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plotting needs matplotlib: pip install -e \".[plot]\" in the mpiring checkout "
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
    for i, (ev, steps) in enumerate(zip(events, table, strict=True)):
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
    idle = [end * ms - c - w for c, w in zip(compute, wait, strict=True)]
    ys = [size - 1 - i for i in range(size)]
    bx.barh(ys, compute, color=colors["full"], label="compute")
    bx.barh(ys, wait, left=compute, color=colors["wait"], label="blocked in wait")
    bx.barh(ys, idle, left=[c + w for c, w in zip(compute, wait, strict=True)], color="#bbbbbb",
            label="idle / finished early")
    for y, c in zip(ys, compute, strict=True):
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


def plot_step_time(path, *, seq_lens, devices, heads, head_dim, kv_heads=None, machines=("nvlink", "infiniband"),
                   variant="zigzag", causal=True, bytes_per_element=2):
    """Plot the time model's step time (compute, transfer, max) against the sequence length.

    One panel per machine; one line per device count in ``devices``. Dotted:
    transfer time per step, dashed: compute; a step costs the larger one.
    """
    plt = _need_matplotlib()
    fig, axes = plt.subplots(1, len(machines), figsize=(5.2 * len(machines), 4.2), squeeze=False,
                             constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for ax, machine in zip(axes[0], machines, strict=True):
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
