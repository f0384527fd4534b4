"""The benchmark table: ring attention's throughput, machine limits, communication and memory, torch beside it.

    mpiexec -n 1 python -m mpiring bench --csv p1.csv
    mpiexec -n 2 python -m mpiring bench --baseline p1.csv --csv bench.csv
    mpiexec -n 2 python -m mpiring bench --long        # long context, 1 head
    run/bench                                          # both runs and the combined table

One rank per core and one BLAS thread per rank; every rank makes random inputs for its own shard only (no
scatter). docs/performance.md explains every column.
"""

import importlib.util
import statistics
import time
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from mpiring import (
    Record,
    make_plan,
    predicted_backward_bytes,
    predicted_bytes_sent,
    release_workspace,
    ring_attention,
    ring_attention_backward,
)
from mpiring.core import backends
from mpiring.core.precision import Precision, named_dtype
from mpiring.core.tuning import gemm
from mpiring.cost.costmodel import format_wire_model
from mpiring.cost.memory import MB, kernel_scratch, memory_model

from ..cli import at_least, barrier, broadcast, command_parser, objects, on_rank0, with_threads
from . import probes
from .infer import inference_rows
from .peers import context_parallel_times, torch_available, torch_times
from .probes import busy_load, limit_seconds
from .sheet import add_efficiency, format_header, format_long, format_table, format_targets, read_csv, write_csv

__all__ = ["Config", "table", "table_parser", "run_config"]


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
    wire: str | None = None  # K/V on the wire (``wire_dtype``): None, the input dtype
    positions: bool = False  # each rank passes its shard of the layout as explicit positions=, not layout=

    @property
    def layout(self):
        return "zigzag" if self.causal else "contiguous"

    @property
    def name(self):
        return "fwd+bwd" if self.backward else "fwd"

    @property
    def precision(self):
        """The row's short name for its dtypes: fp32, bf16, int8w (fp32 inputs, int8 wire), ..."""
        short = {"float32": "fp32", "float64": "fp64", "float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        return short if self.wire is None else f"{short}/{self.wire}w" if self.dtype != "float32" else f"{self.wire}w"


# ---------------------------------------------------------------- running one configuration


def _local_inputs(cfg, plan, rank, seed):
    """Random q, k, v (and dout) for this rank's shard only: (B, H, n_local, D)."""
    rng = np.random.default_rng([seed, rank])
    shape = (cfg.B, cfg.H, len(plan.shards[rank]), cfg.D)
    dtype = named_dtype(cfg.dtype)
    arrays = [rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False) for _ in range(3)]
    if cfg.backward:
        arrays.append(rng.standard_normal(shape, dtype=np.float32).astype(dtype, copy=False))
    return arrays


def _one_run(q, k, v, dout, comm, cfg, plan):
    """One timed pass; returns (wall, wait, compute, bytes) of this rank."""
    barrier(comm, spin=True)
    rec = Record(comm.Get_rank())
    held = {"positions": plan.shards[comm.Get_rank()]} if cfg.positions else {"layout": cfg.layout}
    start = time.perf_counter()
    out, lse = ring_attention(q, k, v, comm, causal=cfg.causal, record=rec, wire_dtype=cfg.wire, **held)
    wait, compute, sent = rec.wait_time, rec.compute_time, rec.bytes_sent
    if cfg.backward:
        brec = Record(comm.Get_rank())
        ring_attention_backward(dout, q, k, v, out, lse, comm, causal=cfg.causal, record=brec, wire_dtype=cfg.wire,
                                **held)
        wait, compute, sent = wait + brec.wait_time, compute + brec.compute_time, sent + brec.bytes_sent
    wall = time.perf_counter() - start
    return wall, wait, compute, sent


def _predicted_bytes(cfg, plan):
    """Bytes per rank predicted by the cost model for this pass."""
    pr = Precision(named_dtype(cfg.dtype), cfg.wire)
    width, e = cfg.B * cfg.H * 2 * pr.wire.row(cfg.D), pr.wire.dtype.itemsize
    forward = predicted_bytes_sent(plan, width, e)
    if not cfg.backward:
        return forward
    grads = predicted_backward_bytes(plan, width, e, pr.grad.itemsize, cfg.B * cfg.H * 2 * cfg.D)
    return [f + b for f, b in zip(forward, grads, strict=True)]


def run_config(comm, cfg, *, repeats=3, budget=30.0, seed=0, limits=None, baseline_mb=0.0,
               guard_mb=None, local_ranks=1):
    """Time one configuration on every rank; returns the row (complete on rank 0)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    plan = make_plan(cfg.S, size, causal=cfg.causal, layout=cfg.layout)
    model = memory_model(cfg, size)
    flops = 4 * cfg.B * cfg.H * cfg.D * sum(plan.visible_pairs()) * (3.5 if cfg.backward else 1)
    row = {"P": size, "S": cfg.S, "D": cfg.D, "H": cfg.H, "B": cfg.B, "causal": int(cfg.causal),
           "layout": cfg.layout + (" (positions)" if cfg.positions else ""), "pass": cfg.name, "dtype": cfg.dtype,
           "wire": cfg.wire or "", "precision": cfg.precision, "model_mb": model["total"] / MB,
           "baseline_mb": baseline_mb}
    need = (model["total"] + kernel_scratch(cfg, plan)) / MB
    if guard_mb is not None and need * local_ranks > 0.8 * guard_mb:
        row["status"] = (f"skipped: needs ~{need:.0f} MiB per rank x {local_ranks} ranks, "
                         f"{guard_mb:.0f} MiB available")
        return row

    release_workspace()  # a row's peak counts its own kept buffers, not those of the rows before it
    probes.reset_peak_rss()
    q, k, v, *rest = _local_inputs(cfg, plan, rank, seed)
    dout = rest[0] if rest else None
    samples, elapsed = [], 0.0
    first = _one_run(q, k, v, dout, comm, cfg, plan)
    slowest = max(objects(comm, first[0]))
    if slowest > budget:  # one run takes the whole budget: the first run counts, cold
        samples.append(first)
        elapsed = slowest
    while len(samples) < repeats and (not samples or elapsed + slowest <= budget):
        samples.append(_one_run(q, k, v, dout, comm, cfg, plan))
        slowest = max(objects(comm, samples[-1][0]))
        elapsed += slowest
    peak = probes.peak_rss_mb()
    del q, k, v, dout, rest

    walls = objects(comm, [s[0] for s in samples], root=0)
    blocked = statistics.median(s[1] / s[0] for s in samples)  # this rank's fraction of wall in Wait
    everyone = objects(comm, blocked)
    comm_frac, wait_frac = min(everyone), max(everyone)
    compute = max(objects(comm, statistics.median(s[2] for s in samples)))
    sent = objects(comm, samples[0][3], root=0)
    peaks = objects(comm, peak, root=0)
    if rank != 0:
        return row
    # a pass ends with its slowest rank
    wall = statistics.median(max(per_rank) for per_rank in zip(*walls, strict=True))
    predicted = _predicted_bytes(cfg, plan)
    row.update(status="ok", repeats=len(samples), wall_s=wall, gflops=flops / wall / 1e9,
               compute_s=compute, exposed_comm=comm_frac, most_wait=wait_frac, bytes_sent=max(sent),
               bytes_predicted=max(predicted), bytes_match=int(list(sent) == list(predicted)),
               peak_rss_mb=max(peaks), rss_per_rank_mb=" ".join(f"{p:.0f}" for p in peaks))
    row["rss_vs_model"] = (row["peak_rss_mb"] - baseline_mb) / (model["total"] / MB) if model["total"] else ""
    row["scratch_mb"] = row["peak_rss_mb"] - baseline_mb - model["total"] / MB
    if limits:
        lim = limit_seconds(limits, cfg, max(plan.visible_pairs()))
        row.update(limit_s=lim, of_limit=lim / wall, kernel_of_limit=lim / compute if compute else "")
    return row


def _torch_seconds(comm, cfg, args, threads=None):
    """Rank 0: torch SDPA's seconds on row ``cfg`` with ``threads`` (default: all the ranks' BLAS threads), the
    other ranks asleep; None if it failed, and on the other ranks."""
    return on_rank0(comm, lambda: torch_times([cfg], threads=threads or comm.Get_size() * args.threads,
                                              repeats=args.repeats, budget=args.budget)[0])


def _alone_seconds(comm, cfg, args, baseline_mb, guard_mb):
    """Rank 0: row ``cfg`` on one rank (COMM_SELF) right after the P-rank row, the others asleep: its wall
    seconds (None if it did not run, and on the other ranks)."""
    def alone():
        one = run_config(MPI.COMM_SELF, cfg, repeats=args.repeats, budget=args.budget * comm.Get_size(),
                         seed=args.seed, baseline_mb=baseline_mb, guard_mb=guard_mb)
        return one["wall_s"] if one.get("status") == "ok" else None
    return on_rank0(comm, alone)


def _peers(comm, cfg, row, args, use_torch, baseline_mb, guard):
    """Beside a row that ran, right after it (the machine's speed drifts over minutes): torch with P threads
    and with one, PyTorch's context parallel, the row on rank 0 alone (``--p1``), and the row and torch again
    beside ``--load`` busy processes. Every rank takes the same branches; the figures land on rank 0."""
    size = comm.Get_size()
    with_torch = use_torch and cfg.precision == "fp32"  # the bf16 and int8 rows compare to fp32
    if with_torch and (t := _torch_seconds(comm, cfg, args)):
        row.update(torch_s=t, torch_gflops=row["gflops"] * row["wall_s"] / t, vs_torch=t / row["wall_s"])
    if with_torch:  # its time, or the error it raised
        t, err = on_rank0(comm, lambda: context_parallel_times([cfg], size)[0], (None, None))
        row.update({"cp_s": t, "vs_cp": t / row["wall_s"]} if t else {"cp_error": err or "no result"})
    if with_torch and size * args.threads == 1:  # torch's own column is its one-thread time
        row.update(torch1_s=row.get("torch_s"), torch1_gflops=row.get("torch_gflops"))
    elif with_torch and (t := _torch_seconds(comm, cfg, args, threads=1)):
        row.update(torch1_s=t, torch1_gflops=row["gflops"] * row["wall_s"] / t)
    if args.p1 and size > 1 and (t := _alone_seconds(comm, cfg, args, baseline_mb, guard)):
        row.update(p1_s=t)
    if args.load > 0:
        with busy_load(args.load if comm.Get_rank() == 0 else 0):
            again = run_config(comm, cfg, repeats=args.repeats, budget=args.budget, seed=args.seed,
                               baseline_mb=baseline_mb)
            t = _torch_seconds(comm, cfg, args) if with_torch else None  # beside the same busy processes
        if comm.Get_rank() == 0:
            row.update(load=args.load, wall_loaded_s=again["wall_s"])
            if t:
                row.update(torch_loaded_s=t, vs_torch_loaded=t / row["wall_loaded_s"])
                if "vs_torch" in row:
                    row["load_drop"] = row["vs_torch"] - row["vs_torch_loaded"]


def _context_parallel_lines(rows, size):
    """The context-parallel peer of every row that has it: its time and x it, or the error it raised."""
    lines = []
    for row in rows:
        if "cp_s" not in row and "cp_error" not in row:
            continue
        t = row.get("cp_s")
        what = f"{t:.3f} s, x context parallel {row['vs_cp']:.2f}" if t else f"failed: {row['cp_error']}"
        lines.append(f"  S={row['S']} D={row['D']} {'causal' if row['causal'] else 'full'} {row['pass']}: {what}")
    if lines:
        lines.insert(0, f"PyTorch context parallel (torch.distributed.tensor.experimental.context_parallel's buffers, "
                        f"its ring on the CPU flash ops, gloo, {size} processes x 1 thread), right after each row:")
    return lines


# ---------------------------------------------------------------- the command


QUICK_SIZES, QUICK_DIMS = [512, 1024], [32, 64]
FULL_SIZES, FULL_DIMS = [4096, 8192, 16384, 32768], [64, 128]
LONG_SIZES = [32768, 65536, 131072, 262144]
PRECISIONS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8w": ("float32", "int8")}


def table_parser():
    p = command_parser("bench", table)
    p.usage = "%(prog)s [SUBCOMMAND] [options]"
    p.add_argument("--quick", action="store_true", help="small sizes, a smoke test (seconds)")
    p.add_argument("--sizes", type=int, nargs="+", metavar="S", help=f"sequence lengths (default {FULL_SIZES})")
    p.add_argument("--dims", type=int, nargs="+", metavar="D", help=f"head dims (default {FULL_DIMS})")
    p.add_argument("--heads", type=int, default=8, help="query heads (= K/V heads)")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median reported)")
    p.add_argument("--budget", type=float, default=30.0, help="seconds per row before repeats stop (>= 1 run)")
    p.add_argument("--no-backward", action="store_true", help="forward only (same as --passes fwd)")
    p.add_argument("--passes", choices=["both", "fwd", "fwd+bwd"], default="both", help="which passes to time")
    p.add_argument("--no-torch", action="store_true", help="skip the torch SDPA column")
    p.add_argument("--mask", choices=["both", "causal", "full"], default="both", help="which masks to time")
    p.add_argument("--long", action="store_true", help="long-context run: 1 head, D=64, causal zigzag, forward")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    p.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    p.add_argument("--baseline", metavar="CSV", help="P=1 rows of an earlier run, for parallel efficiency")
    p.add_argument("--p1", action="store_true",
                   help="time each row again on rank 0 alone right after it (the other ranks asleep), for "
                        "parallel efficiency measured in this run (instead of --baseline's)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.add_argument("--precisions", nargs="+", choices=list(PRECISIONS), default=list(PRECISIONS),
                   help="fp32: float32 inputs; bf16: bfloat16 inputs; int8w: float32 inputs, K/V sent as int8 "
                        "(the last two: forward causal rows only)")
    p.add_argument("--positions", action="store_true", help="pass each rank's shard of the layout as explicit "
                   "positions= instead of layout= (the same tokens: times should not change)")
    p.add_argument("--inference", choices=["auto", "on", "off", "only"], default="auto",
                   help="the inference rows (decode tree vs ring over a 64k cache, prefill pass-KV vs pass-Q): "
                        "auto = with the full table, not with --quick or --long")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="also time every row (and its torch column) with N busy background processes "
                        "started by rank 0 (0: idle only)")
    p.checks.append(at_least(0, **{"--load": "load"}))
    return p


def _configs(args):
    if args.long:
        sizes = args.sizes or LONG_SIZES
        return [Config(S, 64, H=1, B=1, causal=True, positions=args.positions) for S in sizes]
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    dims = args.dims or (QUICK_DIMS if args.quick else FULL_DIMS)
    masks = {"both": (False, True), "causal": (True,), "full": (False,)}[args.mask]
    passes = {"both": (False, True), "fwd": (False,), "fwd+bwd": (True,)}[args.passes]
    if args.no_backward:
        passes = (False,)
    # every forward row before any fwd+bwd row: a process keeps some memory of a larger row (MPI's buffers,
    # heap fragments) that the RSS reset cannot return, and a forward row measured after it would count it
    extra = [PRECISIONS[p] for p in args.precisions if p != "fp32"  # bf16 inputs, int8 wire: forward causal rows
             and (p != "bf16" or importlib.util.find_spec("ml_dtypes"))]  # no bf16 rows without ml_dtypes
    plain = "fp32" in args.precisions
    return [Config(S, D, H=args.heads, B=args.batch, causal=c, backward=b, dtype=dtype, wire=wire,
                   positions=args.positions)
            for b in passes for S in sizes for D in dims for c in masks
            for dtype, wire in ([("float32", None)] if plain else []) + ([] if b or not c else extra)]


def _row_kernel(cfg, size):
    """The kernel backend of a row's blocks (S/P query rows): "torch", or "numpy+torch" for forward and backward."""
    dtype = named_dtype(cfg.dtype)
    names = dict.fromkeys(backends.for_block(dtype, cfg.S // size, backward=b) for b in (False, cfg.backward))
    return "+".join(names)


def _machine(comm, configs, quick):
    """What rank 0 measures before the first row, the others asleep: the machine (CPU, kernel backend, FMA
    peak), the BLAS report, and one core's limits (these on every rank)."""
    def measure():
        machine = {"cpu": probes.cpu_text(), "kernel": backends.describe(), "fma_peak": probes.fma_peak_flops()}
        limits = probes.measure_limits(sorted({c.D for c in configs}), n=256 if quick else 1024,
                                       repeats=3 if quick else 5)
        return machine, probes.blas_report(), limits
    machine, report, limits = on_rank0(comm, measure, (None, None, None))
    return machine, report, broadcast(comm, limits)


@with_threads(table_parser, user_api="blas")
def table(comm, args):
    """Time ring attention on every rank; rank 0 prints the benchmark table and writes CSV."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.inference == "only":
        inference_rows(comm, quick=args.quick)
        return 0
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_ranks = local.Get_size()
    local.Free()
    configs = _configs(args)
    quick = args.quick and not args.sizes
    clock = probes.load_clock(comm)
    use_torch = not args.no_torch and not args.long and torch_available()
    gemm.product()  # the kernels' GEMM library (MKL, when used) loaded: its code is baseline, not data
    tiny = np.ones((1, 16, 64), np.float32)
    for name in dict.fromkeys(n for cfg in configs for n in _row_kernel(cfg, size).split("+")
                              if n == "numpy" or n in backends.available()):  # torch imported only if a row uses it
        with backends.using(name):  # so is each kernel backend's the rows use (torch: ~190 MB resident)
            backends.attention_block(tiny, tiny, tiny)
    baseline_mb = max(objects(comm, probes.rss_mb()))  # interpreter + libraries, before any array
    machine, report, limits = _machine(comm, configs, quick)
    guard = broadcast(comm, probes.available_mb() if rank == 0 else None)
    if rank == 0:
        print(format_header(size=size, threads=args.threads, long=args.long, rows=len(configs), report=report,
                            limits=limits, baseline_mb=baseline_mb, use_torch=use_torch, load=args.load,
                            machine=machine))
    rows = []
    for cfg in configs:
        start = probes.load_clock(comm)
        row = run_config(comm, cfg, repeats=args.repeats, budget=args.budget, seed=args.seed, limits=limits,
                         baseline_mb=baseline_mb, guard_mb=guard, local_ranks=local_ranks)
        load = probes.background_cores(comm, start)  # other processes' cores while this row ran (idle part)
        if broadcast(comm, row.get("status") == "ok" if rank == 0 else None):  # rank 0 decides for all
            _peers(comm, cfg, row, args, use_torch, baseline_mb, guard)
        if rank == 0:
            row.update(blas=report["blas"], blas_arch=report["blas_arch"], blas_threads=args.threads,
                       background_cores="" if load is None else load, kernel=_row_kernel(cfg, size),
                       cpu=machine["cpu"])
            for key, name, cores in (("gflops", "of_peak", size * args.threads),
                                     ("torch_gflops", "torch_of_peak", size * args.threads),
                                     ("torch1_gflops", "torch1_of_peak", 1)):
                if machine["fma_peak"] and row.get(key):
                    row[name] = row[key] * 1e9 / (cores * machine["fma_peak"])
            rows.append(row)
            print(format_table([row], loaded=args.load > 0).splitlines()[1], flush=True)
    if args.inference == "on" or (args.inference == "auto" and not (args.quick or args.long or args.sizes)):
        if rank == 0:
            print("\ninference rows (python -m mpiring bench --inference only):", flush=True)
        inference_rows(comm, quick=args.quick)
    others = probes.background_cores(comm, clock)
    return _report(args, rows, configs, size, limits, others) if rank == 0 else 0


def _report(args, rows, configs, size, limits, others):
    """Rank 0, after the last row: the whole table (with the baseline's rows), its summary, the peers, CSV."""
    baseline_rows = read_csv(args.baseline) if args.baseline else []
    add_efficiency(rows, baseline_rows)
    everything = [r for r in baseline_rows if r.get("P") != size] + rows
    print()
    print(format_table(everything, loaded=args.load > 0))
    summary = format_long(rows) if args.long else format_targets(everything, limits)
    if summary:
        print("\n" + summary)
    if not args.long and len({c.precision for c in configs}) > 1:  # where the bf16 and int8 wires pay
        big = max(configs, key=lambda c: (c.S, c.D))
        print("\nthis machine computes too slowly for the wire to matter; on accelerators (time model, P=8, the "
              "largest row's shape and 64k tokens):")
        for S in (big.S, 65536):
            print(format_wire_model(S, 8, heads=big.H, head_dim=big.D, batch=big.B, causal=True))
    cp_lines = _context_parallel_lines(rows, size)
    if cp_lines:
        print("\n" + "\n".join(cp_lines))
    if others is not None:
        print(f"\nbackground load: other processes kept {others:.2f} cores busy on average during this run"
              + (" -- timings are unreliable, rerun on an idle machine" if others > 0.1 else ""))
    if args.csv:
        write_csv(everything, args.csv)
        print(f"\nwrote {args.csv}")
    return 0
