"""The benchmark table's rows on paper: CSV in and out, parallel efficiency, the table and its summaries."""

import csv
import math
import os

__all__ = ["COLUMNS", "write_csv", "read_csv", "add_efficiency", "format_table", "format_header", "format_long",
           "format_targets"]

# CSV columns, in order
COLUMNS = [
    "P", "S", "D", "H", "B", "causal", "layout", "pass", "dtype", "wire", "precision", "status", "repeats",
    "wall_s", "gflops", "limit_s", "of_limit", "compute_s", "kernel_of_limit",
    "torch_s", "torch_gflops", "vs_torch", "torch1_s", "torch1_gflops", "of_peak", "torch_of_peak", "torch1_of_peak",
    "cp_s", "vs_cp", "cp_error",
    "p1_s", "efficiency", "exposed_comm", "most_wait",
    "bytes_sent", "bytes_predicted", "bytes_match",
    "peak_rss_mb", "rss_per_rank_mb", "model_mb", "baseline_mb", "rss_vs_model", "scratch_mb",
    "blas", "blas_arch", "blas_threads", "kernel", "cpu", "background_cores",
    "load", "wall_loaded_s", "torch_loaded_s", "vs_torch_loaded", "load_drop",
]


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


# ---------------------------------------------------------------- CSV


def write_csv(rows, path):
    """Write benchmark rows to ``path`` with the ``COLUMNS`` header."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k, "")) for k in COLUMNS})


def _csv_value(v):
    return f"{v:.6g}" if isinstance(v, float) else v


def _parsed(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def read_csv(path):
    """Rows of a benchmark CSV, numbers converted back."""
    with open(path, newline="") as f:
        return [{key: _parsed(val) for key, val in raw.items()} for raw in csv.DictReader(f)]


def _row_key(row):
    return (int(row["S"]), int(row["D"]), int(row["H"]), int(row["B"]), int(row["causal"]), row["pass"],
            row.get("precision") or "fp32")  # CSVs from before the precision column: fp32 rows


def add_efficiency(rows, baseline_rows):
    """Fill ``efficiency`` = T(P=1) / (P * T(P)): T(P=1) timed right after the row (``p1_s``, ``bench --p1``),
    else from P=1 rows (this run's or a baseline's)."""
    ones = {_row_key(r): r["wall_s"] for r in list(baseline_rows) + list(rows)
            if r.get("P") == 1 and _num(r.get("wall_s"))}
    for row in rows:
        one = row.get("p1_s") if _num(row.get("p1_s")) else ones.get(_row_key(row))
        if one is not None and _num(row.get("wall_s")) and row["P"] > 1:
            row["efficiency"] = one / (row["P"] * row["wall_s"])
    return rows


# ---------------------------------------------------------------- the table


def _fmt(v, spec, width):
    return (format(v, spec) if _num(v) else "-").rjust(width)


TABLE = [  # header, key, format, width
    ("P", "P", "d", 2), ("S", "S", "d", 6), ("D", "D", "d", 4), ("mask", None, "", 7), ("pass", "pass", "", 7),
    ("prec", "precision", "", 5),
    ("wall s", "wall_s", ".3f", 8), ("GFLOP/s", "gflops", ".1f", 8), ("%lim", "of_limit", ".0%", 5),
    ("kern%", "kernel_of_limit", ".0%", 6), ("%peak", "of_peak", ".0%", 5), ("torch", "torch_gflops", ".1f", 6),
    ("x torch", "vs_torch", ".2f", 7), ("torch1", "torch1_gflops", ".1f", 6), ("t1%pk", "torch1_of_peak", ".0%", 5),
    ("eff", "efficiency", ".0%", 5), ("comm%", "exposed_comm", ".1%", 6), ("wait%", "most_wait", ".1%", 6),
    ("bytes/rank", "bytes_sent", "d", 11),
    ("=model", "bytes_match", "", 6), ("RSS MB", "peak_rss_mb", ".0f", 7), ("model+base", None, "", 10),
    ("ratio", "rss_vs_model", ".2f", 6), ("bg", "background_cores", ".1f", 4),
]
LOADED = [  # with --load N: the same pass under N busy background processes, and torch under the same load
    ("wall@L", "wall_loaded_s", ".3f", 8), ("torch@L", "torch_loaded_s", ".3f", 8),
    ("x torch@L", "vs_torch_loaded", ".2f", 9), ("drop", "load_drop", ".2f", 5),
]


def format_table(rows, loaded=False):
    """The benchmark table as text (rows that were skipped say why); ``loaded``: the columns of ``--load``."""
    table = TABLE + (LOADED if loaded else [])
    lines = ["  ".join(h.rjust(w) for h, _, _, w in table)]
    for row in rows:
        cells = []
        for header, key, spec, width in table:
            if header == "mask":
                cells.append(("causal" if row.get("causal") else "full").rjust(width))
            elif header == "model+base":
                total = (row.get("model_mb") or 0) + (row.get("baseline_mb") or 0)
                cells.append(_fmt(total, ".0f", width))
            elif header == "=model":
                match = row.get("bytes_match")
                cells.append(("yes" if match == 1 else "NO" if match == 0 else "-").rjust(width))
            elif header in ("pass", "prec"):
                cells.append(str(row.get(key) or ("fp32" if header == "prec" else "")).rjust(width))
            else:
                cells.append(_fmt(row.get(key), spec, width))
        line = "  ".join(cells)
        if str(row.get("status", "ok")) != "ok":
            line = "  ".join(cells[:6]) + "  " + str(row["status"])
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------- around the table


def format_header(*, size, threads, long, rows, report, limits, baseline_mb, use_torch, load=0, machine=None):
    """What the run measured before the first row: CPU, BLAS, kernel backend, one core's limits and FMA peak, RSS."""
    lines = [f"mpiring bench: P={size} ranks, {threads} BLAS thread(s) per rank, fp32 (and bf16/int8-wire rows), "
             f"{rows} rows{' (long context)' if long else ''}"]
    if machine:
        peak = machine.get("fma_peak")
        lines.append(f"CPU: {machine['cpu']}; kernel backend {machine['kernel']}; FMA peak, one "
                     f"core (float32): " + (f"{peak / 1e9:.1f} GFLOP/s (%peak: of {size} x that)" if peak
                                            else "not measured (no C compiler)"))
    lines += [
             f"BLAS: {report['blas']}, kernels {report['blas_arch']}, threads per rank {threads}"
             + (f", OPENBLAS_CORETYPE={report['coretype_env']}" if report["coretype_env"] else "")]
    if report["warning"]:
        lines.append(f"{'WARNING' if 'below' in report['warning'] else 'NOTE'}: {report['warning']}")
    for d, lim in limits.items():
        lines.append(f"limit, one core: D={d}: {lim.get('gemm_name', 'np.matmul')} {lim['gemm_flops'] / 1e9:.1f} "
                     f"GFLOP/s, np.{lim['exp_fn']} {lim['exp_per_s'] / 1e9:.2f} G/s")
    if limits:
        first = next(iter(limits.values()))
        peak = first["peak_flops"]
        lines.append(f"ceiling: {first.get('gemm_name', 'np.matmul')} 2048x2048x2048 on one core {peak / 1e9:.1f} "
                     f"GFLOP/s; no attention kernel "
                     f"on {size} rank(s) x {threads} thread(s) can pass {size * threads * peak / 1e9:.0f} GFLOP/s")
    peers = f"yes, {size * threads} threads (torch) and 1 (torch1)" if use_torch else "no"
    lines.append(f"interpreter baseline RSS {baseline_mb:.0f} MiB per rank; torch SDPA columns: {peers}")
    if load:
        lines.append(f"load: every row (and its torch column) timed again with {load} busy background "
                     f"process(es) started by rank 0 (columns @L)")
    lines += ["", format_table([], loaded=load > 0)]
    return "\n".join(lines)


def format_long(rows):
    """Memory per rank as S grows: peak RSS, the model, and the scratch beyond model + baseline ("" if no rows).

    The model counts the float64 running (out, lse) (``memory_model``'s ``running_out`` and ``lse``): what is
    beyond it is the kernel's scratch and the allocator's."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return ""
    lines = ["long context: memory per rank (MiB) as S grows",
             "       S  tokens/rank  peak RSS per rank  model  baseline  beyond model"]
    for r in ok:
        lines.append(f"{r['S']:>8}  {math.ceil(r['S'] / r['P']):>11}  {r['rss_per_rank_mb']:>17}  "
                     f"{r['model_mb']:>5.0f}  {r['baseline_mb']:>8.0f}  {r['scratch_mb']:>12.0f}")
    a, b = ok[0], ok[-1]
    if len(ok) > 1:
        lines.append(f"S x{b['S'] / a['S']:.0f}: model x{b['model_mb'] / a['model_mb']:.1f} (O(S/P)); beyond the "
                     f"model {a['scratch_mb']:.0f} -> {b['scratch_mb']:.0f} MiB")
    return "\n".join(lines)


# the targets at S=16384, D=64, H=8, P=2, fp32: (label, row key, goal, ">=" or "<=", how the value is shown)
TARGETS = [
    ("x torch", "vs_torch", {"fwd": 1.15, "fwd+bwd": 1.1}, ">=", ".3f"),
    ("kernel of limit", "kernel_of_limit", 0.95, ">=", ".3f"),
    ("efficiency", "efficiency", 0.97, ">=", ".3f"),
    ("exposed comm", "exposed_comm", 0.01, "<=", ".2%"),
    ("RSS/model", "rss_vs_model", 1.5, "<=", ".2f"),
]
LOAD_DROP = 0.1  # with --load: "x torch" under load no more than this below the idle ratio


def _check(label, value, goal, op, spec):
    """``label value (op goal met|MISSED)``, or ``label -`` without a value."""
    if not _num(value):
        return f"{label} -"
    met = value >= goal if op == ">=" else value <= goal
    shown = format(goal, ".0%") if spec.endswith("%") else format(goal, "g")
    return f"{label} {format(value, spec)} ({op}{shown} {'met' if met else 'MISSED'})"


def _loaded_line(r):
    """The row under ``--load``: x torch under the load against idle, and the drop's target ("" if not run)."""
    if not _num(r.get("wall_loaded_s")):
        return ""
    load = r.get("load")
    if not _num(r.get("vs_torch_loaded")):
        return f"loaded: wall {r['wall_loaded_s']:.3f} s under load {load} (idle {r['wall_s']:.3f} s), no torch column"
    if not _num(r.get("load_drop")):
        return f"loaded: x torch {r['vs_torch_loaded']:.2f} under load {load} (idle -, drop -)"
    met = "met" if r["load_drop"] <= LOAD_DROP else "MISSED"
    return (f"loaded: x torch {r['vs_torch_loaded']:.2f} under load {load} "
            f"(idle {r['vs_torch']:.2f}, drop {r['load_drop']:.3f} <= {LOAD_DROP:g} {met})")


def format_targets(rows, limits=None):
    """The performance targets at S=16384, D=64, P=2 (whichever rows this run has; "" if none).

    Under each row, bounds of "x torch": with every rank's kernel at the matmul+exp limit (torch's time over
    the row's ``limit_s``), and with ``limits`` the ceiling of P cores of square GEMM; under ``--load``, "x
    torch" under the load and its drop from idle against ``LOAD_DROP``.
    """
    pick = {(r["pass"], r["causal"]): r for r in rows
            if r.get("P") == 2 and r.get("S") == 16384 and r.get("D") == 64 and r.get("H") == 8
            and r.get("status") == "ok" and (r.get("precision") or "fp32") == "fp32"}
    if not pick:
        return ""
    lines = ["targets at S=16384, D=64, H=8, P=2, fp32:"]
    for (name, causal), r in sorted(pick.items()):
        mask = "causal" if causal else "full"
        parts = [_check(label, r.get(key), goal[name] if isinstance(goal, dict) else goal, op, spec)
                 for label, key, goal, op, spec in TARGETS]
        lines.append(f"  {name:>7} {mask:>6}: " + "; ".join(parts))
        bounds = []
        if _num(r.get("vs_torch")) and _num(r.get("of_limit")):
            bounds.append(f"at the matmul+exp limit = {r['vs_torch'] / r['of_limit']:.2f}x torch")
        if limits and _num(r.get("torch_gflops")) and r["D"] in limits:
            ceiling = r["P"] * limits[r["D"]]["peak_flops"] / 1e9 / r["torch_gflops"]
            bounds.append(f"ceiling: {r['P']} cores of square GEMM = {ceiling:.2f}x torch")
        if bounds:
            lines.append(f"  {'':>7} {'':>6}  ({'; '.join(bounds)})")
        loaded = _loaded_line(r)
        if loaded:
            lines.append(f"  {'':>7} {'':>6}  {loaded}")
    return "\n".join(lines)
