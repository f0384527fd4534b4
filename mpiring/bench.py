"""Benchmark of ring attention: throughput, machine limits, communication, memory.

    mpiexec -n 1 python -m mpiring bench --csv p1.csv
    mpiexec -n 2 python -m mpiring bench --baseline p1.csv --csv bench.csv
    mpiexec -n 2 python -m mpiring bench --long        # long context, 1 head
    run/bench                                          # both runs and the combined table

One rank per core and one BLAS thread per rank. Every rank makes random inputs
for its own shard only (no root scatter), so memory per rank is O(S/P) plus
the kernel's scratch. Columns (see docs/performance.md):

- wall: median over repeats of the slowest rank's ``ring_attention`` time
  (forward+backward: the forward and the backward ring back to back).
- GFLOP/s: forward 4*B*H*D*visible pairs; forward+backward 3.5x that
  (FlashAttention's count: 2 GEMMs forward, 5 backward).
- limit: the same work at the single-core rate of ``np.matmul`` on the GEMM
  shapes of a tile, plus the faster of ``np.exp``/``np.exp2`` on one exponential
  per visible pair (two for forward+backward), measured at the start of the run;
  the busiest rank's share of the pairs. ``%lim`` = limit / wall,
  ``kern%`` = limit / time inside the kernels and merges.
- eff: parallel efficiency T(P=1) / (P * T(P)) against a baseline CSV of P=1.
- comm%: the largest fraction of wall any rank spent blocked in Wait.
- bytes: bytes each rank sent, checked against ``predicted_bytes_sent``.
- RSS: peak resident memory per rank (VmHWM, reset before each row) against
  ``memory_model`` plus the interpreter baseline measured at start.
- torch: ``torch.nn.functional.scaled_dot_product_attention`` on the whole
  sequence with P threads, in a child process while the ranks idle.
- bg: cores kept busy by other processes while the row ran (0 on an idle machine).
"""

import csv
import ctypes
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import numpy as np

__all__ = ["Config", "run", "add_arguments", "memory_model", "measure_limits", "blas_report",
           "read_csv", "write_csv", "format_table", "COLUMNS"]

MB = 2**20

# CSV columns, in order
COLUMNS = [
    "P", "S", "D", "H", "B", "causal", "layout", "pass", "status", "repeats",
    "wall_s", "gflops", "limit_s", "of_limit", "compute_s", "kernel_of_limit",
    "torch_s", "torch_gflops", "vs_torch", "efficiency", "exposed_comm",
    "bytes_sent", "bytes_predicted", "bytes_match",
    "peak_rss_mb", "rss_per_rank_mb", "model_mb", "baseline_mb", "rss_vs_model", "scratch_mb",
    "blas", "blas_arch", "blas_threads", "background_cores",
]


@dataclass(frozen=True)
class Config:
    """One row of the benchmark: the problem and which pass is timed."""

    S: int
    D: int
    H: int = 8
    B: int = 1
    causal: bool = False
    backward: bool = False
    dtype: str = "float32"

    @property
    def layout(self):
        return "zigzag" if self.causal else "contiguous"

    @property
    def name(self):
        return "fwd+bwd" if self.backward else "fwd"

    def key(self):
        return (self.S, self.D, self.H, self.B, self.causal, self.name)


# ---------------------------------------------------------------- machine facts


def _status_kb(field):
    """A ``Vm...`` field of /proc/self/status in kB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_mb():
    """Current resident set size in MiB."""
    kb = _status_kb("VmRSS")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def peak_rss_mb():
    """Peak resident set size since the last ``reset_peak_rss`` (or process start), MiB."""
    kb = _status_kb("VmHWM")
    if kb is None:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def reset_peak_rss():
    """Give freed heap back to the OS and reset the peak (Linux: clear_refs 5). True if reset."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_mb():
    """MemAvailable of /proc/meminfo in MiB (None if unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def busy_cpu_seconds():
    """CPU seconds all processes of the machine have used so far (/proc/stat; None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process and its finished children."""
    import resource

    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _blas_pools():
    from threadpoolctl import threadpool_info

    return [p for p in threadpool_info() if p.get("user_api") == "blas"]


def _child_env():
    """This environment without the MPI launcher's variables: a child must not join the job."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_"))}


def _gemm_probe(n=1024, d=64, repeats=5):
    """This process's BLAS: kernel family and single-thread fp32 GFLOP/s on one attention tile's GEMMs."""
    from threadpoolctl import threadpool_limits

    pools = _blas_pools()
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((n, d), dtype=np.float32), rng.standard_normal((n, d), dtype=np.float32)
    s, o = np.empty((n, n), np.float32), np.empty((n, d), np.float32)

    def gemms():
        np.matmul(q, k.T, out=s)
        np.matmul(s, k, out=o)

    with threadpool_limits(1, user_api="blas"):
        seconds = _best(gemms, repeats)
    return {"arch": pools[0].get("architecture") if pools else None, "gflops": 4 * n * n * d / seconds / 1e9}


def blas_report(check_free=True):
    """BLAS library, version, kernel family and threads; warns about a forced OPENBLAS_CORETYPE.

    When OPENBLAS_CORETYPE is set, a child interpreter without it tells which
    kernels OpenBLAS picks by itself and how fast its GEMMs run on one core; the
    same GEMMs are timed here, and a forced kernel family that is slower (or
    different, when the timing is unclear) is reported as a warning.
    """
    pools = _blas_pools()
    pool = pools[0] if pools else {}
    report = {
        "blas": f"{pool.get('internal_api', 'unknown')} {pool.get('version', '')}".strip(),
        "blas_arch": pool.get("architecture") or "unknown",
        "blas_threads": pool.get("num_threads", 0),
        "coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
        "free_arch": None,
        "warning": None,
    }
    if report["coretype_env"] and check_free and pool.get("internal_api") == "openblas":
        env = {k: v for k, v in _child_env().items() if k != "OPENBLAS_CORETYPE"}
        try:  # this file as a script: no package import, so no MPI in the child
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--gemm-probe"], env=env,
                                 capture_output=True, text=True, timeout=120, check=True).stdout
            free = json.loads(out.strip().splitlines()[-1])
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            free = {"arch": None, "gflops": None}
        report["free_arch"] = free["arch"]
        if free["arch"] and free["arch"].lower() != str(report["blas_arch"]).lower():
            forced = _gemm_probe()["gflops"]
            speed = (f"; one-core GEMM {forced:.0f} GFLOP/s forced vs {free['gflops']:.0f} free"
                     if free["gflops"] else "")
            verdict = ("below what the CPU can do" if not free["gflops"] or free["gflops"] > 1.05 * forced
                       else "not slower on this CPU")
            report["warning"] = (f"OPENBLAS_CORETYPE={report['coretype_env']} forces {report['blas_arch']} kernels; "
                                 f"OpenBLAS picks {free['arch']} on this CPU when the variable is unset{speed} "
                                 f"(forced kernels: {verdict})")
    return report


def measure_limits(dims, n=1024, repeats=5, dtype=np.float32):
    """Single-core ``np.matmul`` FLOP/s and exponentials/s on one attention tile of ``n`` x ``n``.

    For each head dim d: the two forward GEMMs of a tile, ``(n, d) @ (d, n)``
    and ``(n, n) @ (n, d)``, timed together (best of ``repeats``), and the faster
    of ``np.exp`` and ``np.exp2`` on n*n scores in [-16, 0) written to a second
    buffer. Also the machine's ceiling: one core's ``np.matmul`` on a square
    2048 x 2048 fp32 product, the fastest GEMM this BLAS runs (no attention
    kernel can beat it, since every score costs 4*d GEMM FLOPs).
    Returns ``{d: {"gemm_flops": .., "exp_per_s": .., "exp_fn": .., "peak_flops": ..}}``.
    """
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(1)
    src = (rng.random((n, n), dtype=np.float32) * -16).astype(dtype)
    dst = np.empty_like(src)
    exp_rate, exp_fn = 0.0, "exp"
    with threadpool_limits(1, user_api="blas"):
        for name, fn in (("exp", np.exp), ("exp2", np.exp2)):
            rate = n * n / _best(lambda fn=fn: fn(src, out=dst), repeats)
            if rate > exp_rate:
                exp_rate, exp_fn = rate, name
        big = rng.standard_normal((2048, 2048), dtype=np.float32)
        peak = 2 * 2048 ** 3 / _best(lambda: np.matmul(big, big), max(2, repeats // 2))
        limits = {}
        for d in dims:
            q = rng.standard_normal((n, d), dtype=np.float32).astype(dtype)
            k = rng.standard_normal((n, d), dtype=np.float32).astype(dtype)
            s, o = np.empty((n, n), dtype), np.empty((n, d), dtype)

            def gemms(q=q, k=k, s=s, o=o):
                np.matmul(q, k.T, out=s)
                np.matmul(s, k, out=o)

            limits[d] = {"gemm_flops": 4 * n * n * d / _best(gemms, repeats), "exp_per_s": exp_rate,
                         "exp_fn": exp_fn, "peak_flops": peak}
    return limits


def _best(fn, repeats):
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def limit_seconds(limits, cfg, pairs):
    """Time of the matmul+exp limit for ``pairs`` visible (query, key) pairs per head."""
    lim = limits[cfg.D]
    gemm = (14 if cfg.backward else 4) * cfg.D / lim["gemm_flops"]
    exps = (2 if cfg.backward else 1) / lim["exp_per_s"]
    return cfg.B * cfg.H * pairs * (gemm + exps)


# ---------------------------------------------------------------- the memory model


def memory_model(cfg, P, kv_heads=None):
    """Bytes per rank the cost model says ring attention holds (the benchmark's definition).

    Seed 000's ``memory_per_gpu`` (local Q and K/V) plus the output and its
    log-sum-exp, plus the two receive buffers of a K/V block that let one block
    arrive while another is in use (only when P > 1). Forward+backward adds
    dout and the dq, dk, dv results (input dtype), their accumulators in the
    backward pass's gradient dtype (float64), and when P > 1 two receive
    buffers of a travelling dK/dV partial and one for the partial coming home.
    Kernel scratch is not in the model: it is what the 0.5x allowance and the
    "scratch" column show.
    """
    from .costmodel import ring_attention_context_parallel

    hk = kv_heads or cfg.H
    e = np.dtype(cfg.dtype).itemsize
    n = math.ceil(cfg.S / P)  # the longest shard
    if cfg.S % P == 0 and hk == cfg.H:
        seed = ring_attention_context_parallel(cfg.S, P, cfg.H * cfg.D, cfg.H, e)["memory_per_gpu_bytes"] * cfg.B
    else:
        seed = cfg.B * n * (cfg.H + 2 * hk) * cfg.D * e
    block = cfg.B * hk * n * cfg.D * e  # one of K or V
    parts = {"seed000_qkv": seed, "out": cfg.B * cfg.H * n * cfg.D * e, "lse": cfg.B * cfg.H * n * e,
             "kv_buffers": 4 * block if P > 1 else 0}
    if cfg.backward:
        from .backward import GRAD_DTYPE

        g = GRAD_DTYPE.itemsize / e  # a gradient element over an input element
        parts["dout_grads"] = 2 * cfg.B * cfg.H * n * cfg.D * e + 2 * block  # dout, dq; dk, dv
        parts["grad_accumulators"] = int(g * (cfg.B * cfg.H * n * cfg.D * e + 2 * block))
        parts["dkv_buffers"] = int(g * 6 * block) if P > 1 else 0
    parts["total"] = sum(parts.values())
    return parts


def kernel_scratch(cfg, plan, rank):
    """Estimated peak scratch bytes of the kernel on ``rank`` (for the out-of-memory guard)."""
    from . import kernels

    e = np.dtype(cfg.dtype).itemsize
    worst = 0
    for source in range(plan.size):
        for a, b, c, d, _, _ in plan.pieces(rank, source):
            worst = max(worst, (b - a) * (d - c))
    if hasattr(kernels, "default_tiles"):  # tiled kernel: O(tile^2) scratch plus padded K/V copies
        tq, tk = kernels.default_tiles(cfg.D, np.dtype(cfg.dtype))
        n = max(len(s) for s in plan.shards)
        tiles = cfg.B * cfg.H * min(tq, n) * min(tk, n) * e * (4 if cfg.backward else 2)
        return tiles + 2 * cfg.B * cfg.H * n * (cfg.D + 1) * e + 3 * cfg.B * cfg.H * n * cfg.D * e
    # dense block kernel: the (rows, cols) scores of every head, a visibility mask, a copy on merge
    scores = cfg.B * cfg.H * worst * e
    return int(scores * (3 if cfg.backward else 1.25) + 2 * worst)


# ---------------------------------------------------------------- running one configuration


def _idle_barrier(comm, poll=0.01):
    """A barrier that sleeps instead of spinning, so an idle rank leaves its core free."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(poll)


def _local_inputs(cfg, plan, rank, seed):
    """Random q, k, v (and dout) for this rank's shard only: (B, H, n_local, D)."""
    rng = np.random.default_rng([seed, rank])
    shape = (cfg.B, cfg.H, len(plan.shards[rank]), cfg.D)
    dtype = np.dtype(cfg.dtype)
    arrays = [rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False) for _ in range(3)]
    if cfg.backward:
        arrays.append(rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False))
    return arrays


def _backward_fn():
    import mpiring

    return getattr(mpiring, "ring_attention_backward", None)


def _call_backward(fn, dout, q, k, v, out, lse, comm, cfg, rec):
    """Call ``ring_attention_backward`` with whatever keywords it accepts."""
    import inspect

    params = inspect.signature(fn).parameters
    kwargs = {key: val for key, val in (("causal", cfg.causal), ("layout", cfg.layout), ("record", rec))
              if key in params}
    return fn(dout, q, k, v, out, lse, comm, **kwargs)


def _one_run(q, k, v, dout, comm, cfg):
    """One timed pass; returns (wall, wait, compute, bytes) of this rank."""
    from .ring import Record, ring_attention

    comm.Barrier()
    rec = Record(comm.Get_rank())
    start = time.perf_counter()
    out, lse = ring_attention(q, k, v, comm, causal=cfg.causal, layout=cfg.layout, record=rec)
    wait, compute, sent = rec.wait_time, rec.compute_time, rec.bytes_sent
    if cfg.backward:
        brec = Record(comm.Get_rank())
        _call_backward(_backward_fn(), dout, q, k, v, out, lse, comm, cfg, brec)
        wait, compute, sent = wait + brec.wait_time, compute + brec.compute_time, sent + brec.bytes_sent
    wall = time.perf_counter() - start
    return wall, wait, compute, sent


def _predicted_bytes(cfg, plan):
    """Bytes per rank predicted by the cost model for this pass."""
    from . import costmodel

    e = np.dtype(cfg.dtype).itemsize
    forward = costmodel.predicted_bytes_sent(plan, cfg.B * cfg.H * 2 * cfg.D, e)
    if not cfg.backward:
        return forward
    from .backward import predicted_backward_bytes

    return [f + b for f, b in zip(forward, predicted_backward_bytes(plan, cfg.B * cfg.H * 2 * cfg.D, e))]


def run_config(comm, cfg, *, repeats=3, budget=30.0, seed=0, limits=None, baseline_mb=0.0,
               guard_mb=None, local_ranks=1):
    """Time one configuration on every rank; returns the row (complete on rank 0)."""
    from .schedule import make_plan

    rank, size = comm.Get_rank(), comm.Get_size()
    plan = make_plan(cfg.S, size, causal=cfg.causal, layout=cfg.layout)
    model = memory_model(cfg, size)
    flops = 4 * cfg.B * cfg.H * cfg.D * sum(plan.visible_pairs()) * (3.5 if cfg.backward else 1)
    row = {"P": size, "S": cfg.S, "D": cfg.D, "H": cfg.H, "B": cfg.B, "causal": int(cfg.causal),
           "layout": cfg.layout, "pass": cfg.name, "model_mb": model["total"] / MB, "baseline_mb": baseline_mb}
    if cfg.backward and _backward_fn() is None:
        row["status"] = "skipped: no ring_attention_backward yet"
        return row
    need = max((model["total"] + kernel_scratch(cfg, plan, r)) / MB for r in range(size))
    if guard_mb is not None and need * local_ranks > 0.8 * guard_mb:
        row["status"] = (f"skipped: needs ~{need:.0f} MiB per rank x {local_ranks} ranks, "
                         f"{guard_mb:.0f} MiB available")
        return row

    reset_peak_rss()
    q, k, v, *rest = _local_inputs(cfg, plan, rank, seed)
    dout = rest[0] if rest else None
    samples, elapsed = [], 0.0
    first = _one_run(q, k, v, dout, comm, cfg)
    slowest = comm.allreduce(first[0], op=_max())
    if slowest * (repeats + 1) > budget:  # too slow to afford a warm-up: the first run counts
        samples.append(first)
        elapsed = slowest
    while len(samples) < repeats and (not samples or elapsed + slowest <= budget):
        samples.append(_one_run(q, k, v, dout, comm, cfg))
        slowest = comm.allreduce(samples[-1][0], op=_max())
        elapsed += slowest
    peak = peak_rss_mb()
    del q, k, v, dout, rest

    walls = comm.gather([s[0] for s in samples], root=0)
    fractions = [s[1] / s[0] for s in samples]
    comm_frac = comm.allreduce(statistics.median(fractions), op=_max())
    compute = comm.allreduce(statistics.median(s[2] for s in samples), op=_max())
    sent = comm.gather(samples[0][3], root=0)
    peaks = comm.gather(peak, root=0)
    if rank != 0:
        return row
    wall = statistics.median(max(per_rank) for per_rank in zip(*walls))  # a pass ends with its slowest rank
    predicted = _predicted_bytes(cfg, plan)
    row.update(status="ok", repeats=len(samples), wall_s=wall, gflops=flops / wall / 1e9,
               compute_s=compute, exposed_comm=comm_frac, bytes_sent=max(sent),
               bytes_predicted="" if predicted is None else max(predicted),
               bytes_match="" if predicted is None else int(list(sent) == list(predicted)),
               peak_rss_mb=max(peaks), rss_per_rank_mb=" ".join(f"{p:.0f}" for p in peaks))
    row["rss_vs_model"] = (row["peak_rss_mb"] - baseline_mb) / (model["total"] / MB) if model["total"] else ""
    row["scratch_mb"] = row["peak_rss_mb"] - baseline_mb - model["total"] / MB
    if limits:
        lim = limit_seconds(limits, cfg, max(plan.visible_pairs()))
        row.update(limit_s=lim, of_limit=lim / wall, kernel_of_limit=lim / compute if compute else "")
    return row


def _max():
    from mpi4py import MPI

    return MPI.MAX


# ---------------------------------------------------------------- torch SDPA in a child process


def torch_available():
    import importlib.util

    return importlib.util.find_spec("torch") is not None


def torch_times(configs, threads, repeats=3, budget=30.0, timeout=3600):
    """Median seconds of torch SDPA per config (None where it failed), from a child process."""
    job = {"configs": [[c.S, c.D, c.H, c.B, c.causal, c.backward, c.dtype] for c in configs],
           "threads": threads, "repeats": repeats, "budget": budget}
    env = dict(_child_env(), OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        # run this file as a script: importing the package would initialize MPI in the child
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker"], input=json.dumps(job),
                              env=env, capture_output=True, text=True, timeout=timeout)
        times = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return [None] * len(configs)
    return times


def _torch_worker():
    """Child process: read a job from stdin, print the median SDPA seconds of each config."""
    import torch
    import torch.nn.functional as F

    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    results = []
    for S, D, H, B, causal, backward, dtype in job["configs"]:
        try:
            gen = torch.Generator().manual_seed(0)
            dt = getattr(torch, dtype)
            q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=dt, requires_grad=backward) for _ in range(3))
            dout = torch.randn(B, H, S, D, generator=gen, dtype=dt) if backward else None

            def once():
                start = time.perf_counter()
                if backward:
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    out.backward(dout)
                    q.grad = k.grad = v.grad = None
                else:
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return time.perf_counter() - start

            first = once()
            samples = [first] if first * (job["repeats"] + 1) > job["budget"] else []
            while len(samples) < job["repeats"] and (not samples or sum(samples) + samples[-1] <= job["budget"]):
                samples.append(once())
            results.append(statistics.median(samples))
        except Exception:  # noqa: BLE001 - report a missing figure, not a crash
            results.append(None)
    print(json.dumps(results))


# ---------------------------------------------------------------- tables and CSV


def write_csv(rows, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k, "")) for k in COLUMNS})


def _csv_value(v):
    if isinstance(v, float):
        return f"{v:.6g}"
    return v


def read_csv(path):
    """Rows of a benchmark CSV, numbers converted back."""
    rows = []
    with open(path, newline="") as f:
        for raw in csv.DictReader(f):
            row = {}
            for key, val in raw.items():
                try:
                    row[key] = int(val)
                except ValueError:
                    try:
                        row[key] = float(val)
                    except ValueError:
                        row[key] = val
            rows.append(row)
    return rows


def _row_key(row):
    return (int(row["S"]), int(row["D"]), int(row["H"]), int(row["B"]), int(row["causal"]), row["pass"])


def add_efficiency(rows, baseline_rows):
    """Fill ``efficiency`` = T(P=1) / (P * T(P)) from P=1 rows (this run's or a baseline's)."""
    ones = {_row_key(r): r for r in list(baseline_rows) + list(rows) if r.get("P") == 1 and _num(r.get("wall_s"))}
    for row in rows:
        one = ones.get(_row_key(row))
        if one is not None and _num(row.get("wall_s")) and row["P"] > 1:
            row["efficiency"] = one["wall_s"] / (row["P"] * row["wall_s"])
    return rows


def _num(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _fmt(v, spec, width):
    return (format(v, spec) if _num(v) else "-").rjust(width)


TABLE = [  # header, key, format, width
    ("P", "P", "d", 2), ("S", "S", "d", 6), ("D", "D", "d", 4), ("mask", None, "", 7), ("pass", "pass", "", 7),
    ("wall s", "wall_s", ".3f", 8), ("GFLOP/s", "gflops", ".1f", 8), ("%lim", "of_limit", ".0%", 5),
    ("kern%", "kernel_of_limit", ".0%", 6), ("torch", "torch_gflops", ".1f", 6), ("x torch", "vs_torch", ".2f", 7),
    ("eff", "efficiency", ".0%", 5), ("comm%", "exposed_comm", ".1%", 6), ("bytes/rank", "bytes_sent", "d", 11),
    ("=model", "bytes_match", "", 6), ("RSS MB", "peak_rss_mb", ".0f", 7), ("model+base", None, "", 10),
    ("ratio", "rss_vs_model", ".2f", 6), ("bg", "background_cores", ".1f", 4),
]


def format_table(rows):
    """The benchmark table as text (rows that were skipped say why)."""
    lines = ["  ".join(h.rjust(w) for h, _, _, w in TABLE)]
    for row in rows:
        cells = []
        for header, key, spec, width in TABLE:
            if header == "mask":
                cells.append(("causal" if row.get("causal") else "full").rjust(width))
            elif header == "model+base":
                total = (row.get("model_mb") or 0) + (row.get("baseline_mb") or 0)
                cells.append(_fmt(total, ".0f", width))
            elif header == "=model":
                match = row.get("bytes_match")
                cells.append(("yes" if match == 1 else "NO" if match == 0 else "-").rjust(width))
            elif header == "pass":
                cells.append(str(row.get("pass", "")).rjust(width))
            else:
                cells.append(_fmt(row.get(key), spec, width))
        line = "  ".join(cells)
        if str(row.get("status", "ok")) != "ok":
            line = "  ".join(cells[:5]) + "  " + str(row["status"])
        lines.append(line)
    return "\n".join(lines)


# ---------------------------------------------------------------- the command


QUICK_SIZES, QUICK_DIMS = [512, 1024], [32, 64]
FULL_SIZES, FULL_DIMS = [4096, 8192, 16384, 32768], [64, 128]
LONG_SIZES = [32768, 65536, 131072, 262144]


def add_arguments(p):
    """The ``bench`` subcommand's options (shared by ``python -m mpiring bench``)."""
    p.add_argument("--quick", action="store_true", help="small sizes, a smoke test (seconds)")
    p.add_argument("--sizes", type=int, nargs="+", metavar="S", help=f"sequence lengths (default {FULL_SIZES})")
    p.add_argument("--dims", type=int, nargs="+", metavar="D", help=f"head dims (default {FULL_DIMS})")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median reported)")
    p.add_argument("--budget", type=float, default=30.0, help="seconds per row before repeats stop (>= 1 run)")
    p.add_argument("--no-backward", action="store_true", help="forward only (same as --passes fwd)")
    p.add_argument("--passes", choices=["both", "fwd", "fwd+bwd"], default="both")
    p.add_argument("--no-torch", action="store_true", help="skip the torch SDPA column")
    p.add_argument("--mask", choices=["both", "causal", "full"], default="both")
    p.add_argument("--long", action="store_true", help="long-context run: 1 head, D=64, causal zigzag, forward")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank (default 1)")
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument("--baseline", metavar="CSV", help="P=1 rows of an earlier run, for parallel efficiency")
    p.add_argument("--seed", type=int, default=0)


def _configs(args):
    if args.long:
        sizes = args.sizes or LONG_SIZES
        return [Config(S, 64, H=1, B=1, causal=True) for S in sizes]
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    dims = args.dims or (QUICK_DIMS if args.quick else FULL_DIMS)
    masks = {"both": (False, True), "causal": (True,), "full": (False,)}[args.mask]
    passes = {"both": (False, True), "fwd": (False,), "fwd+bwd": (True,)}[args.passes]
    if args.no_backward or args.long:
        passes = (False,)
    # every forward row before any fwd+bwd row: a process keeps some memory of a larger row
    # (MPI's buffers, heap fragments) that the RSS reset cannot return, and a forward row
    # measured after a fwd+bwd row would count it (about 50 MiB at S=16384).
    return [Config(S, D, H=args.heads, B=args.batch, causal=c, backward=b)
            for b in passes for S in sizes for D in dims for c in masks]


def run(args, comm):
    """The benchmark on ``comm``: every rank times, rank 0 prints the table and writes CSV."""
    from threadpoolctl import threadpool_limits

    rank, size = comm.Get_rank(), comm.Get_size()
    threadpool_limits(args.threads, user_api="blas")
    baseline_mb = comm.allreduce(rss_mb(), op=_max())  # interpreter + numpy + mpi4py, before any array
    local = comm.Split_type(_shared_type())
    local_ranks = local.Get_size()
    local.Free()
    configs = _configs(args)
    quick = args.quick and not args.sizes
    clock = (time.perf_counter(), busy_cpu_seconds(), comm.allreduce(own_cpu_seconds()))
    report = limits = None
    use_torch = not args.no_torch and not args.long and torch_available()
    if rank == 0:
        report = blas_report()
        limits = measure_limits(sorted({c.D for c in configs}), n=256 if quick else 1024,
                                repeats=3 if quick else 5)
    _idle_barrier(comm)
    limits = comm.bcast(limits, root=0)
    guard = comm.bcast(available_mb() if rank == 0 else None, root=0)
    if rank == 0:
        _print_header(args, size, report, limits, baseline_mb, configs, use_torch)
    rows = []
    for cfg in configs:
        start = (time.perf_counter(), busy_cpu_seconds(), comm.allreduce(own_cpu_seconds()))
        row = run_config(comm, cfg, repeats=args.repeats, budget=args.budget, seed=args.seed, limits=limits,
                         baseline_mb=baseline_mb, guard_mb=guard, local_ranks=local_ranks)
        load = _background_load(comm, start)  # other processes' cores while this row ran
        if rank == 0:
            row.update(blas=report["blas"], blas_arch=report["blas_arch"], blas_threads=args.threads,
                       background_cores="" if load is None else load)
            rows.append(row)
            print(format_table([row]).splitlines()[1], flush=True)
    if use_torch:  # rank 0 runs torch with P threads while the other ranks sleep
        if rank == 0:
            todo = [(i, c) for i, c in enumerate(configs) if rows[i].get("status") == "ok"]
            times = torch_times([c for _, c in todo], threads=size * args.threads, repeats=args.repeats,
                                budget=args.budget)
            for (i, cfg), t in zip(todo, times):
                if t:
                    flops = rows[i]["gflops"] * rows[i]["wall_s"]
                    rows[i].update(torch_s=t, torch_gflops=flops / t, vs_torch=t / rows[i]["wall_s"])
        _idle_barrier(comm)
    others = _background_load(comm, clock)
    if rank != 0:
        return 0
    baseline_rows = read_csv(args.baseline) if args.baseline else []
    add_efficiency(rows, baseline_rows)
    everything = [r for r in baseline_rows if r.get("P") != size] + rows
    print()
    print(format_table(everything))
    if args.long:
        _print_long(rows)
    else:
        _print_targets(everything, report, limits)
    if others is not None:
        print(f"\nbackground load: other processes kept {others:.2f} cores busy on average during this run"
              + (" -- timings are unreliable, rerun on an idle machine" if others > 0.1 else ""))
    if args.csv:
        write_csv(everything, args.csv)
        print(f"\nwrote {args.csv}")
    return 0


def _background_load(comm, clock):
    """Cores kept busy by processes other than the ranks (and their children) since ``clock``."""
    start, busy, own = clock
    own = comm.allreduce(own_cpu_seconds()) - own
    now = busy_cpu_seconds()
    if busy is None or now is None:
        return None
    return max(0.0, (now - busy - own) / (time.perf_counter() - start))


def _shared_type():
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def _print_header(args, size, report, limits, baseline_mb, configs, use_torch):
    print(f"mpiring bench: P={size} ranks, {args.threads} BLAS thread(s) per rank, fp32, "
          f"{len(configs)} rows{' (long context)' if args.long else ''}")
    print(f"BLAS: {report['blas']}, kernels {report['blas_arch']}, threads per rank {args.threads}"
          + (f", OPENBLAS_CORETYPE={report['coretype_env']}" if report["coretype_env"] else ""))
    if report["warning"]:
        print(f"{'WARNING' if 'below' in report['warning'] else 'NOTE'}: {report['warning']}")
    for d, lim in limits.items():
        print(f"limit, one core: D={d}: np.matmul {lim['gemm_flops'] / 1e9:.1f} GFLOP/s, "
              f"np.{lim['exp_fn']} {lim['exp_per_s'] / 1e9:.2f} G/s")
    if limits:
        peak = next(iter(limits.values()))["peak_flops"]
        print(f"ceiling: np.matmul 2048x2048x2048 on one core {peak / 1e9:.1f} GFLOP/s; no attention kernel "
              f"on {size} rank(s) x {args.threads} thread(s) can pass {size * args.threads * peak / 1e9:.0f} GFLOP/s")
    print(f"interpreter baseline RSS {baseline_mb:.0f} MiB per rank; "
          f"torch SDPA column: {'yes, ' + str(size * args.threads) + ' threads' if use_torch else 'no'}")
    print()
    print(format_table([]))


def _print_long(rows):
    """Memory per rank as S grows: peak RSS, the model, and the scratch beyond model + baseline."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return
    print("\nlong context: memory per rank (MiB) as S grows")
    print("       S  tokens/rank  peak RSS per rank  model  baseline  beyond model  float64 (out, lse)  rest")
    for r in ok:
        print(f"{r['S']:>8}  {math.ceil(r['S'] / r['P']):>11}  {r['rss_per_rank_mb']:>17}  {r['model_mb']:>5.0f}  "
              f"{r['baseline_mb']:>8.0f}  {r['scratch_mb']:>12.0f}  {_running_mb(r):>18.1f}  "
              f"{r['scratch_mb'] - _running_mb(r):>4.0f}")
    a, b = ok[0], ok[-1]
    if len(ok) > 1:
        print(f"S x{b['S'] / a['S']:.0f}: model x{b['model_mb'] / a['model_mb']:.1f} (O(S/P)); beyond the model "
              f"{a['scratch_mb']:.0f} -> {b['scratch_mb']:.0f} MiB, of which the float64 running (out, lse) "
              f"{_running_mb(a):.0f} -> {_running_mb(b):.0f} MiB (O(S/P), by design) and the rest "
              f"{a['scratch_mb'] - _running_mb(a):.0f} -> {b['scratch_mb'] - _running_mb(b):.0f} MiB")


def _running_mb(row):
    """MiB of the forward pass's float64 running (out, lse) on the longest shard (ring._accumulators)."""
    n = math.ceil(row["S"] / row["P"])
    return row["B"] * row["H"] * n * (row["D"] + 1) * 8 / MB


def _print_targets(rows, report, limits=None):
    """Issue 5's targets at S=16384, D=64, P=2 (whichever rows this run has).

    With ``limits``, also the ceiling of "x torch": two cores' square-GEMM
    speed over torch's, the most any kernel could reach on this machine.
    """
    pick = {(r["pass"], r["causal"]): r for r in rows
            if r.get("P") == 2 and r.get("S") == 16384 and r.get("D") == 64 and r.get("status") == "ok"}
    if not pick:
        return
    forced = bool(report and report.get("coretype_env"))
    print("\ntargets (issue 5) at S=16384, D=64, H=8, P=2:")
    for (name, causal), r in sorted(pick.items()):
        mask = "causal" if causal else "full"
        need = 1.0 if (name == "fwd+bwd" or forced) else 1.5
        checks = [("x torch", r.get("vs_torch"), need, ">="), ("kernel of limit", r.get("kernel_of_limit"), 0.85, ">="),
                  ("efficiency", r.get("efficiency"), 0.95, ">="), ("exposed comm", r.get("exposed_comm"), 0.02, "<="),
                  ("RSS/model", r.get("rss_vs_model"), 1.5, "<=")]
        parts = []
        for label, val, goal, op in checks:
            if not _num(val):
                parts.append(f"{label} -")
                continue
            met = val >= goal if op == ">=" else val <= goal
            parts.append(f"{label} {val:.2f} ({op}{goal:g} {'met' if met else 'MISSED'})")
        print(f"  {name:>7} {mask:>6}: " + "; ".join(parts))
        if limits and _num(r.get("torch_gflops")) and r["D"] in limits:
            ceiling = r["P"] * limits[r["D"]]["peak_flops"] / 1e9 / r["torch_gflops"]
            print(f"  {'':>7} {'':>6}  (ceiling: {r['P']} cores of square GEMM = {ceiling:.2f}x torch)")


if __name__ == "__main__":  # child processes started by the benchmark (never import mpi4py here)
    if sys.argv[1:] == ["--torch-worker"]:
        _torch_worker()
    elif sys.argv[1:] == ["--gemm-probe"]:
        print(json.dumps(_gemm_probe()))
