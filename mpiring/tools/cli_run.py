"""The ``run`` command: ring attention on seeded inputs under mpiexec, verified and reported on rank 0.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal --layout zigzag
    mpiexec -n 4 python -m mpiring run --causal --backward
    mpiexec -n 4 python -m mpiring run --causal --trace trace.json --plot timeline.png

The check builds its reference from the definitions (``mpiring.reference``),
never from the plan or the masks under test.
"""

import os
import sys

import numpy as np
from threadpoolctl import threadpool_limits

from mpiring import (
    distributed_attention,
    distributed_attention_backward,
    predicted_backward_bytes,
    predicted_bytes_sent,
    ring_attention_context_parallel,
)
from mpiring.reference import definition_mask, dense_attention, dense_attention_backward

from .calibrate import calibrate
from .cli import add_variant_args, command_parser, variant
from .cli_plan import compute_table
from .plot import plot_timeline
from .progress import Progress
from .report import format_timeline, timing_report
from .trace import write_chrome_trace

__all__ = ["run", "run_parser", "VERIFY_TOL"]

# what `run` accepts against the float64 single-process reference
VERIFY_TOL = {np.float64: 1e-10, np.float32: 1e-4}


def run_parser():
    p = command_parser("run", run)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of the whole sequence")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, help="K/V heads (grouped-query attention); default = heads")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="dtype of Q, K, V")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (rank 0 makes them)")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank may wait for the others before the job aborts (0 = forever)")
    p.add_argument("--no-verify", action="store_true", help="skip the single-process reference")
    p.add_argument("--backward", action="store_true", help="also run the backward pass and verify the gradients")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in ui.perfetto.dev or chrome://tracing)")
    p.add_argument("--plot", metavar="FILE", help="draw a timeline (Gantt chart) PNG; needs matplotlib")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="ring step counter on rank 0 (auto: when output is a terminal)")
    add_variant_args(p)
    return p


def run(comm, args=None):
    """Make seeded inputs on rank 0, run ring attention on every rank, verify and report on rank 0."""
    args = run_parser().parse_args(args)
    threadpool_limits(args.threads)
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    hk = args.kv_heads or args.heads
    options = variant(args)
    Q = K = V = None
    if rank == 0:
        rng = np.random.default_rng(args.seed)
        Q = rng.standard_normal((args.batch, args.heads, args.seq_len, args.dim)).astype(dtype)
        K, V = (rng.standard_normal((args.batch, hk, args.seq_len, args.dim)).astype(dtype) for _ in range(2))
    comm.Barrier()
    if args.backward:
        return _run_backward(args, comm, Q, K, V, options)
    progress = Progress("ring step (rank 0)", enabled={"auto": None, "on": True, "off": False}[args.progress])
    out, sched = distributed_attention(Q, K, V, comm, timeout=args.timeout or None, **options,
                                       on_step=progress if rank == 0 else None)
    progress.close()
    n_local = args.seq_len // size
    machine = calibrate(comm, head_dim=args.dim, dtype=args.dtype, tokens=max(16, min(n_local, 1024)),
                        seconds=0.2, threads=args.threads,
                        nbytes=min(max(2 * args.batch * hk * n_local * args.dim * dtype.itemsize, 1 << 16), 1 << 26))
    if rank != 0:
        return 0
    plan, records = sched.plan, sched.records
    wall = max(r["wall_time"] for r in records)
    flops = 4 * args.batch * args.heads * args.dim * sum(plan.visible_pairs())
    itemsize = dtype.itemsize
    predicted = predicted_bytes_sent(plan, args.batch * hk * 2 * args.dim, itemsize)
    print(f"mpiring run: P={size} seq_len={args.seq_len} batch={args.batch} heads={args.heads} kv_heads={hk} "
          f"dim={args.dim} {dtype} causal={plan.causal} layout={plan.layout} mode={plan.mode} window={plan.window}")
    print("\nschedule as recorded by the ranks:")
    print(sched.format())
    for r, rec in enumerate(records):
        rec["blocks_computed"] = sum(t.kind != "skip" for row in sched.table for t in row[r])
    print(compute_table(plan, records))
    agrees = sched == plan.schedule and [r["visible_pairs"] for r in records] == plan.visible_pairs()
    print(f"recorded schedule equals the plan: {'yes' if agrees else 'NO'}")
    print("\nrank  bytes sent  predicted  messages  compute s  blocked in wait s")
    for r, rec in enumerate(records):
        print(f"{r:>4}  {rec['bytes_sent']:>10}  {predicted[r]:>9}  {rec['messages']:>8}  "
              f"{rec['compute_time']:>9.4f}  {rec['wait_time']:>17.4f}")
    if args.seq_len % size == 0 and plan.mode != "bidirectional":
        report = ring_attention_context_parallel(args.seq_len, size, hk * args.dim, args.heads, itemsize)
        print(f"cost report: total_comm_bytes per rank x batch = {report['total_comm_bytes'] * args.batch}"
              f" (full ring; windows/documents may stop it early)")
    print(f"\nwall time {wall:.4f} s   attention {flops / wall / 1e9:.2f} GFLOP/s "
          f"(4*B*H*D*visible pairs = {flops / 1e9:.3f} GFLOP)")
    ok = agrees and all(r["bytes_sent"] == p for r, p in zip(records, predicted, strict=True))
    if not args.no_verify:
        ref, _ = dense_attention(Q, K, V, mask=_reference_mask(args))
        err = float(np.max(np.abs(out - ref)))
        tol = VERIFY_TOL[dtype.type]
        ok = ok and err <= tol
        print(f"max abs error vs single-process float64 reference: {err:.3e} (tolerance {tol:g})")
    print()
    print(timing_report(records, plan, machine, batch=args.batch, heads=args.heads, kv_heads=hk, head_dim=args.dim,
                        itemsize=itemsize, ranks_per_core=size * args.threads / (os.cpu_count() or 1)))
    print("\ntimeline (text; --plot FILE draws it, --trace FILE for Perfetto):")
    print(format_timeline(records))
    _write_trace_and_plot(args, records, f"P={size} {plan.layout} {plan.mode}{' causal' if plan.causal else ''}, "
                          f"seq_len={args.seq_len}, H={args.heads} d={args.dim} {dtype}")
    print("VERIFIED" if ok else "VERIFICATION FAILED")
    return 0 if ok else 1


def _reference_mask(args):
    """Rows a:b of the mask asked for on the command line, from the definitions (``mpiring.reference``).

    Built from the arguments, not from the plan or ``mpiring.masks``: a bug in
    the code under test cannot make its own reference agree with it.
    """
    pos = np.arange(args.seq_len)
    return lambda a, b: definition_mask(pos[a:b], pos, causal=args.causal, window=args.window,
                                        cu_seqlens=args.cu_seqlens)


def _write_trace_and_plot(args, records, title):
    """``run --trace FILE`` and ``--plot FILE`` on rank 0."""
    if args.trace:
        write_chrome_trace(args.trace, records, title=title)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        size, cores = len(records), os.cpu_count() or 1
        shared = size * args.threads > cores
        note = f"{size} ranks on {cores} cores share them: times are not meaningful" if shared else None
        try:
            plot_timeline(records, args.plot, title=title, note=note)
            print(f"timeline written to {args.plot}")
        except ImportError as exc:  # matplotlib is an optional extra: the run itself still counts
            print(f"--plot skipped: {exc}", file=sys.stderr)


def _run_backward(args, comm, Q, K, V, options):
    """``run --backward``: forward and backward through the ring, both checked against float64 references."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    dOut = None
    if rank == 0:
        dOut = np.random.default_rng(args.seed + 1).standard_normal(Q.shape).astype(dtype)
    out, dQ, dK, dV, sched = distributed_attention_backward(Q, K, V, dOut, comm, timeout=args.timeout or None,
                                                            return_out=True, **options)
    if rank != 0:
        return 0
    plan, records = sched.plan, sched.records
    hk = K.shape[-3]
    kv_width = args.batch * hk * 2 * args.dim
    fwd_bytes = predicted_bytes_sent(plan, kv_width, dtype.itemsize)
    bwd_bytes = predicted_backward_bytes(plan, kv_width, dtype.itemsize)
    bwd_messages = plan.backward_messages_per_rank()
    print(f"mpiring run --backward: P={size} seq_len={args.seq_len} batch={args.batch} heads={args.heads} "
          f"kv_heads={hk} dim={args.dim} {dtype} causal={plan.causal} layout={plan.layout} mode={plan.mode} "
          f"window={plan.window}")
    print("\nbackward schedule as recorded by the ranks (K/V and their dK/dV partials follow the forward plan):")
    print(sched.format())
    agrees = sched == plan.schedule
    print(f"recorded schedule equals the plan: {'yes' if agrees else 'NO'}")
    print("\n      forward               backward")
    print("rank  bytes sent  predicted  bytes sent   predicted  messages  predicted  compute s  blocked in wait s")
    for r, rec in enumerate(records):
        print(f"{r:>4}  {rec['forward']['bytes_sent']:>10}  {fwd_bytes[r]:>9}  {rec['bytes_sent']:>10}  "
              f"{bwd_bytes[r]:>10}  {rec['messages']:>8}  {bwd_messages:>9}  {rec['compute_time']:>9.4f}  "
              f"{rec['wait_time']:>17.4f}")
    print("(backward bytes: K/V in the input dtype, their travelling dK/dV partials in float64)")
    flops = 4 * args.batch * args.heads * args.dim * sum(plan.visible_pairs())
    for name, wall, factor in (("forward ", max(r["forward"]["wall_time"] for r in records), 1.0),
                               ("backward", max(r["wall_time"] for r in records), 2.5)):
        print(f"{name} wall time {wall:.4f} s   {factor * flops / wall / 1e9:.2f} GFLOP/s "
              f"({factor * flops / 1e9:.3f} GFLOP)")
    print("FLOPs: forward 4*B*H*D*visible pairs; backward 2.5x forward, as FlashAttention counts")
    ok = agrees and all(r["bytes_sent"] == p and r["messages"] == bwd_messages
                        for r, p in zip(records, bwd_bytes, strict=True))
    ok = ok and all(r["forward"]["bytes_sent"] == p for r, p in zip(records, fwd_bytes, strict=True))
    if not args.no_verify:
        tol = VERIFY_TOL[dtype.type]
        got = (out, dQ, dK, dV)
        mask = _reference_mask(args)
        want = (dense_attention(Q, K, V, mask=mask)[0],) + dense_attention_backward(dOut, Q, K, V, mask=mask)
        print(f"\nmax abs error vs single-process float64 reference (tolerance {tol:g}):")
        for name, a, b in zip(("out", "dQ", "dK", "dV"), got, want, strict=True):
            err = float(np.max(np.abs(a - b)))
            ok = ok and err <= tol
            print(f"  {name:>3} {err:.3e}   (max |reference| {float(np.max(np.abs(b))):.3g})")
    _write_trace_and_plot(args, records, f"backward pass: P={size} {plan.layout} {plan.mode}"
                          f"{' causal' if plan.causal else ''}, seq_len={args.seq_len}, H={args.heads} d={args.dim}")
    print("VERIFIED" if ok else "VERIFICATION FAILED")
    return 0 if ok else 1
