"""The benchmark's close-ups: one core's kernel (``percore``) and its tuning (``tune``), one rank's planning
(``plan``), a call's fixed cost (``overhead``) and one ring step's overlap (``overlap``).

    python -m mpiring bench percore                  # 8 heads x 4096 x 4096, D=64, float32, 2 torch threads
    python -m mpiring bench tune                     # GEMM backend and tiles for this CPU, cached (idle machine)
    python -m mpiring bench plan -P 64 256 1024 4096 --causal --layout zigzag
    mpiexec -n 2 python -m mpiring bench overhead
    run/cluster run -n 2 python -m mpiring bench overlap --seq-len 8192 --causal
"""

import json
import math
import time
import types

import numpy as np
from threadpoolctl import threadpool_limits

import mpiring
from mpiring.core import backends
from mpiring.core.kernels import LOG2E
from mpiring.core.tiles import default_tiles, pad_ones
from mpiring.core.tuning import gemm
from mpiring.core.tuning.machine import cache_path, cached, machine_key
from mpiring.core.tuning.tune import tune as run_tune
from mpiring.plans.make import make_plan

from ..cli import add_variant_args, at_least, command_parser, table_text, variant
from .peers import torch_available, torch_times
from .probes import best_seconds, cpu_text, fma_peak_flops, limit_seconds, measure_limits

__all__ = ["percore", "percore_parser", "kernel_steps", "plan", "plan_parser", "plan_times", "overhead",
           "overhead_parser", "overlap", "overlap_parser", "transfer_time", "tune", "tune_parser"]


def _shape_args(p, repeats, seq=None, seq_flag="--seq-len"):
    """The options the close-ups share: heads, head dim, repeats, and (``seq``) tokens."""
    sizes = {"--heads": "heads", "--dim": "dim", "--repeats": "repeats"}
    if seq is not None:
        p.add_argument(seq_flag, type=int, default=seq, help="tokens")
        sizes[seq_flag] = seq_flag[2:].replace("-", "_")
    p.add_argument("--heads", type=int, default=8, help="heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--repeats", type=int, default=repeats, help="timed runs of each")
    p.checks.append(at_least(1, **sizes))
    return p


# ---------------------------------------------------------------- percore: one core, one block


def percore_parser():
    p = _shape_args(command_parser("bench percore", percore), 5, seq=4096, seq_flag="--seq")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=int, default=2, help="torch's threads for the P-thread comparison (P)")
    p.add_argument("--no-torch", action="store_true", help="leave torch out")
    p.checks.append(at_least(1, **{"--threads": "threads"}))
    return p


def kernel_steps(q, kt, vt, scale, tile_q, tile_k):
    """A function running the forward kernel's three steps alone over a block, on the kernel's tiles.

    ``q`` (B, S, D); ``kt``, ``vt`` the padded ``[k | 1]ᵀ``, ``[v | 1]ᵀ``. Per (query tile, key tile):
    scores = (scale·log2 e·q | 0)·[k | 1]ᵀ, exp2 in place, scores·[v | 1] added into a float accumulator by
    the GEMM. Returns ``(run, acc)``: acc (B, tile_q, Dv+1) holds what ``run()`` added up, over every query tile.
    """
    mm = gemm.product()
    b, sq, d = q.shape
    sk, dv = kt.shape[-1], vt.shape[1] - 1
    qa = np.zeros((b, sq, d + 1), q.dtype)    # the offset column: 0 here (the kernel puts -m there)
    np.multiply(q, scale * LOG2E, out=qa[..., :d])
    s = np.empty((b, min(tile_q, sq), min(tile_k, sk)), q.dtype)
    acc = np.zeros((b, min(tile_q, sq), dv + 1), q.dtype)

    def run():
        for a in range(0, sq, tile_q):
            n = min(a + tile_q, sq) - a
            for c in range(0, sk, tile_k):
                tile = s[:, :n, :min(c + tile_k, sk) - c]
                mm(qa[:, a:a + n], kt[:, :, c:c + tile_k], tile)
                np.exp2(tile, out=tile)
                mm(tile, vt[:, :, c:c + tile_k].transpose(0, 2, 1), acc[:, :n], beta=1.0)

    return run, acc


def percore(comm=None, args=None):
    """One core, one block: the forward kernel against its own GEMMs and exp2, the limit, and torch (no MPI)."""
    args = percore_parser().parse_args(args)
    dt, seq, h, d = np.dtype(args.dtype), args.seq, args.heads, args.dim
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((h, seq, d)).astype(dt) for _ in range(3))
    kt, vt = pad_ones(k), pad_ones(v)
    scale, flops = 1.0 / math.sqrt(d), 4 * h * seq * seq * d
    # the block as a benchmark row: what limit_seconds and torch_times take
    cfg = types.SimpleNamespace(S=seq, D=d, H=h, B=1, causal=False, backward=False, dtype=args.dtype)
    rows = {}
    with threadpool_limits(1, user_api="blas"):
        tq, tk = default_tiles(d, dt)
        limits = measure_limits([d], dtype=dt)
        rows["the matmul+exp limit"] = limit_seconds(limits, cfg, seq * seq)
        run, _ = kernel_steps(q, kt, vt, scale, tq, tk)
        rows["the kernel's three steps on its tiles"] = best_seconds(run, args.repeats)
        out, lse = np.zeros((h, seq, d)), np.full((h, seq), -np.inf)
        for name in [b for b in backends.available() if not (args.no_torch and b == "torch")]:
            with backends.using(name):
                padded = backends.takes_padded(dt, seq)  # K/V in the form the ring keeps for this backend
                kv = (kt, vt) if padded else (k, v)
                rows[f"the kernel (attention_block), {name}"] = best_seconds(
                    lambda: backends.attention_block(q, *kv, scale, padded=padded, into=(out, lse)),  # noqa: B023
                    args.repeats)
    torch_p = None
    if not args.no_torch and torch_available():
        one = torch_times([cfg], 1, repeats=args.repeats)[0]
        torch_p = torch_times([cfg], args.threads, repeats=args.repeats)[0]
        if one:
            rows["torch SDPA, 1 thread"] = one
    peak = fma_peak_flops()
    print(f"one core of {cpu_text()}: {h} heads x {seq} queries x {seq} keys, D={d}, {dt.name}, full mask; "
          f"GEMMs: {limits[d]['gemm_name']}; kernel tiles {tq} x {tk}; FMA peak "
          + (f"{peak / 1e9:.1f} GFLOP/s (float32)" if peak else "not measured (no C compiler)"))
    print(f"  {'':<40} {'ms':>9} {'GFLOP/s':>8} {'of limit':>9} {'of peak':>8}")
    limit = rows["the matmul+exp limit"]
    for name, sec in rows.items():
        of_peak = f"{flops / sec / peak:8.0%}" if peak else f"{'-':>8}"
        print(f"  {name:<40} {sec * 1e3:9.3f} {flops / sec / 1e9:8.1f} {limit / sec:9.2f} {of_peak}")
    if torch_p:
        p = args.threads
        print(f"torch SDPA, {p} threads: {torch_p * 1e3:.1f} ms, {flops / torch_p / 1e9:.1f} GFLOP/s "
              f"({flops / torch_p / 1e9 / p:.1f} per thread)")
        print(f"{p} ranks, each as fast as one core above, against torch with {p} threads on this block "
              f"(a ring at efficiency 1):")
        for name, sec in rows.items():
            print(f"  {name:<40} {torch_p * p / sec:5.2f}x torch")
    elif not args.no_torch:
        print("torch: not installed (pip install torch) or it failed: no torch rows")
    return 0


# ---------------------------------------------------------------- plan: one rank's planning as P grows


def plan_parser():
    p = command_parser("bench plan", plan)
    p.add_argument("-P", "--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096], help="numbers of ranks")
    p.add_argument("--tokens-per-rank", type=int, default=256, help="S = this x P")
    p.add_argument("--repeats", type=int, default=3, help="the best of this many")
    add_variant_args(p)
    return p


def _own_steps(plan, rank):
    """What ``rank`` reads of ``plan`` while it runs: its tasks at every step and their pieces."""
    pieces = 0
    for step in range(plan.n_steps):
        for task in plan.tasks(step, rank):
            pieces += len(plan.block_pieces(task.source) if plan.mode == "ulysses" else plan.pieces(rank, task.source))
    return pieces


def plan_times(size, seq_len, repeats=3, **options):
    """``(make_plan s, one rank's steps s, steps, pieces)`` for ``size`` ranks over ``seq_len`` tokens (CPU time)."""
    clock, plans, pieces = time.process_time, [], []
    made = best_seconds(lambda: plans.append(make_plan(seq_len, size, **options)), repeats, clock)
    own = best_seconds(lambda: pieces.append(_own_steps(make_plan(seq_len, size, **options), size // 2)), repeats,
                       clock)
    return made, max(own - made, 0.0), plans[-1].n_steps, pieces[-1]


def plan(comm=None, args=None):
    """Time one rank's planning as P grows: make_plan, then its own steps (no MPI)."""
    args = plan_parser().parse_args(args)
    options = variant(args)
    shown = ", ".join(f"{k}={v}" for k, v in options.items() if v not in (None, False) and k != "layout")
    print(f"CPU: {cpu_text()}; layout {args.layout}{', ' + shown if shown else ''}; "
          f"S = {args.tokens_per_rank} x P; CPU seconds, best of {args.repeats}")
    rows = []
    for size in args.ranks:
        made, own, steps, pieces = plan_times(size, args.tokens_per_rank * size, args.repeats, **options)
        rows.append([size, args.tokens_per_rank * size, f"{made:.4f}", f"{own:.4f}", steps, pieces])
    print(table_text(["P", "S", "make_plan s", "+ one rank's steps s", "steps", "pieces"], rows, markdown=True))
    return 0


# ---------------------------------------------------------------- overhead: a call's fixed cost


def overhead_parser():
    p = _shape_args(command_parser("bench overhead", overhead), 20)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 1024], help="sequence lengths")
    return p


def _calls(comm, S, heads, dim, repeats, use_ring):
    """Median (wall, ring, kernel) seconds of forward + backward per call on this rank."""
    rng = np.random.default_rng([S, comm.rank])
    n = len(mpiring.shard_indices(S, comm.size, comm.rank, "zigzag"))
    q, k, v, dout = (rng.standard_normal((1, heads, n, dim)).astype(np.float32) for _ in range(4))
    options = dict(causal=True, layout="zigzag")
    ring = mpiring.Ring(comm, S, **options) if use_ring else None
    walls, rings, kernels = [], [], []
    for _ in range(repeats + 1):  # the first call warms up
        forward, backward = mpiring.Record(), mpiring.Record()
        comm.Barrier()
        start = time.perf_counter()
        if use_ring:
            out, lse = ring.forward(q, k, v, record=forward)
            ring.backward(dout, q, k, v, out, lse, record=backward)
        else:
            out, lse = mpiring.ring_attention(q, k, v, comm, record=forward, **options)
            mpiring.ring_attention_backward(dout, q, k, v, out, lse, comm, record=backward, **options)
        walls.append(time.perf_counter() - start)
        rings.append(forward.wall_time + backward.wall_time)
        kernels.append(forward.compute_time + backward.compute_time)
    if ring is not None:
        ring.close()
    return tuple(float(np.median(x[1:])) for x in (walls, rings, kernels))


def overhead(comm, args=None):
    """The fixed cost of a call (forward + backward): the call's wall time less the ring's own (``Record``),
    through the functions and through a ``Ring``; least over ranks, and the most (waiting for the others)."""
    from mpi4py import MPI

    args = overhead_parser().parse_args(args)
    rows = []
    for S in args.sizes:
        for name, use_ring in (("functions", False), ("Ring", True)):
            wall, ring, kernel = _calls(comm, S, args.heads, args.dim, args.repeats, use_ring)
            wall, ring, kernel, most, waits = (comm.allreduce(x, op=MPI.MAX)
                                               for x in (wall, ring, kernel, wall - ring, ring - kernel))
            least = comm.allreduce(wall - ring, op=MPI.MIN)  # the rank the others wait for: the call's own cost
            rows.append([S, name] + [f"{x * 1e3:.2f}" for x in (wall, ring, kernel, least)]
                        + [f"up to {most * 1e3:.2f}", f"{waits * 1e3:.2f}"])
    if comm.rank == 0:
        print(f"forward + backward per call, P={comm.size}, H={args.heads}, D={args.dim}, fp32, causal zigzag; "
              f"median of {args.repeats}, slowest rank")
        print(table_text(["S", "entry", "call ms", "ring ms", "kernels ms", "fixed cost ms", "(other ranks)",
                          "ring waits ms"], rows))
    return 0


# ---------------------------------------------------------------- overlap: does a ring step hide its transfer?


def overlap_parser():
    p = _shape_args(command_parser("bench overlap", overlap), 3, seq=8192)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="contiguous")
    return p


def transfer_time(k, v, comm, repeat):
    """Seconds one ring step's K/V transfer takes with nothing computed (median over ``repeat``; all ranks)."""
    from mpi4py import MPI

    from mpiring.core.buffers import KVBuffers
    from mpiring.mpi.comm import RingComm

    with RingComm(comm) as ring:
        buffers = KVBuffers((k, v), k.shape[-2])
        held = buffers.hold((k, v))
        times = []
        for _ in range(repeat):
            incoming = buffers.take(k.shape[-2])
            comm.Barrier()
            start = time.perf_counter()
            ring.shift({+1: held}, {+1: incoming}, pad=1)
            ring.wait()
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def overlap(comm, args=None):
    """One ring step's K/V transfer alone (the ring's own messages, nothing computed), then per step and repeat
    of ``ring_attention`` the rank blocked longest: its compute, its blocked time, and the bound
    ``max(0, transfer - compute)`` a perfectly overlapped step leaves. It measures; it does not judge."""
    args = overlap_parser().parse_args(args)
    threadpool_limits(1)
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(rank)
    q, k, v = (rng.standard_normal((1, args.heads, args.seq_len // size, args.dim)).astype(np.float32)
               for _ in range(3))
    transfer = transfer_time(k, v, comm, args.repeats)
    runs = []
    for _ in range(args.repeats):
        rec = mpiring.Record(rank)
        mpiring.ring_attention(q, k, v, comm, causal=args.causal, layout=args.layout, record=rec)
        steps = {}
        for name, start, end, info in rec.events:
            if name in ("compute", "wait"):
                steps.setdefault(info["step"], {"compute": 0.0, "wait": 0.0})[name] += end - start
        runs.append(steps)
    everyone = comm.gather(runs, root=0)
    if rank != 0:
        return 0
    rows = []
    for rep in range(args.repeats):
        for step in sorted(everyone[0][rep])[:-1]:  # the last step sends nothing
            r = max(range(size), key=lambda x: everyone[x][rep][step]["wait"])  # noqa: B023
            compute, blocked = everyone[r][rep][step]["compute"], everyone[r][rep][step]["wait"]
            rows.append([rep, step, r, f"{compute:.3f}", f"{blocked:.3f}", f"{max(0.0, transfer - compute):.3f}"])
    print(f"P={size} seq_len={args.seq_len} heads={args.heads} dim={args.dim} float32 causal={args.causal} "
          f"layout={args.layout}; K/V block {2 * k.nbytes / 1e6:.2f} MB per rank and step")
    print(f"transfer alone (one step's K/V, nothing computed): {transfer:.3f} s")
    print("per step, the rank blocked longest:")
    print(table_text(["repeat", "step", "rank", "compute s", "blocked s", "bound max(0, transfer - compute) s"],
                     rows))
    return 0


# ---------------------------------------------------------------- tune: the kernel's GEMM backend and tiles


def tune_parser():
    p = command_parser("bench tune", tune)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], metavar="D", help="head dims")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "float64"],
                   help="compute dtypes (half inputs compute in float32)")
    p.add_argument("--seq", type=int, default=2048, help="tokens of the timed block (queries = keys)")
    p.add_argument("--heads", type=int, default=8, help="heads of the timed block")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per candidate (the fastest counts)")
    p.add_argument("--backends", nargs="+", choices=gemm.BACKENDS, help="GEMM backends to try "
                   "(default: every one installed here)")
    p.add_argument("--show", action="store_true", help="print the cached choice for this machine and stop")
    p.add_argument("--no-write", action="store_true", help="time and print, but leave the cache alone")
    p.checks.append(at_least(1, **{"--seq": "seq", "--heads": "heads", "--repeats": "repeats"}))
    p.checks.append(lambda a: next((f"--dims {d}: must be at least 1" for d in a.dims if d < 1), None))
    p.checks.append(lambda a: next((f"--backends {b}: not installed here (pip install mpiring[mkl])"
                                    for b in a.backends or [] if b not in gemm.available()), None))
    return p


def tune(comm=None, args=None):
    """Time GEMM backends and tile sizes on one core of this CPU; cache the fastest here."""
    args = tune_parser().parse_args(args)
    path = cache_path()
    print(f"machine: {machine_key()}")
    print(f"cache: {path or 'off (MPIRING_TUNE_CACHE=off)'}")
    if args.show:
        entry = cached()
        print(json.dumps(entry, indent=1, sort_keys=True) if entry else "nothing cached for this machine")
        return 0
    entry = run_tune(dims=args.dims, dtypes=args.dtypes, seq=args.seq, heads=args.heads, repeats=args.repeats,
                     backends=args.backends, write=not args.no_write)
    print(f"\nfastest backend: {entry['gemm']} (total s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in entry["backend_seconds"].items()) + ")")
    for kind, table in entry["tiles"].items():
        for dtype, dims in table.items():
            print(f"  {kind} {dtype}: " + ", ".join(f"D={d} tiles {tq} x {tk}" for d, (tq, tk) in dims.items()))
    print("cached" if path and not args.no_write else "not cached (--no-write or cache off)")
    return 0
