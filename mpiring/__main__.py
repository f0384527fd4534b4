"""Command line: ``python -m mpiring run|schedule|cost``.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal
    python -m mpiring schedule -P 4 --layout zigzag --causal
    mpiexec -n 4 python -m mpiring run --causal --trace trace.json --plot timeline.png   # see the ring
    python -m mpiring cost --seq-len 1048576 -P 8 --hidden 4096 --heads 32 --causal    # + time model
    mpiexec -n 2 python -m mpiring bench --quick        # the benchmark table (run/bench runs -n 1 and -n 2)

Each subcommand is a function ``(args, comm) -> exit code`` that prints on rank 0 only.
"""

import argparse
import os
import sys
import time
import traceback

import numpy as np

COMMANDS = {}


def _register(func):
    COMMANDS[func.__name__.rstrip("_")] = func
    return func


def _add_variant_args(p):
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag", "striped"])
    p.add_argument("--mode", default="ring", choices=["ring", "bidirectional", "allgather"])
    p.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="sliding window; -1 = unbounded")
    p.add_argument("--cu-seqlens", type=int, nargs="+", metavar="N", help="packed documents: 0 e1 e2 ... seq_len")


def _add_time_model_args(p):
    p.add_argument("--dim", type=int, help="head dim (default hidden / heads); K/V heads = hidden / dim (GQA)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action="store_true", help="causal mask (zigzag/striped halve the work per step)")
    p.add_argument("--preset", nargs="+", default=["nvlink", "infiniband"],
                   choices=["nvlink", "infiniband", "this-machine"], help="machines for the time model")
    p.add_argument("--flops", type=float, help="a custom machine: FLOP/s (with --bandwidth, --latency)")
    p.add_argument("--bandwidth", type=float, help="custom machine: bytes/s per direction")
    p.add_argument("--latency", type=float, default=10e-6, help="custom machine: seconds per transfer")


def _variant(args):
    return dict(causal=args.causal, layout=args.layout, mode=args.mode,
                window=tuple(args.window) if args.window else None,
                cu_seqlens=np.array(args.cu_seqlens) if args.cu_seqlens else None)


def _parser():
    parser = argparse.ArgumentParser(prog="python -m mpiring", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run ring attention under mpiexec and verify it")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, help="K/V heads (grouped-query attention); default = heads")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank (default 1)")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="seconds a rank may wait for the others before the job aborts (default 60; 0 = forever)")
    p.add_argument("--no-verify", action="store_true", help="skip the single-process reference")
    p.add_argument("--backward", action="store_true", help="also run the backward pass and verify the gradients")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in ui.perfetto.dev or chrome://tracing)")
    p.add_argument("--plot", metavar="FILE", help="draw a timeline (Gantt chart) PNG; needs matplotlib")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="ring step counter on rank 0 (auto: when output is a terminal)")
    _add_variant_args(p)

    p = sub.add_parser("schedule", help="print the ring schedule (no MPI needed)")
    p.add_argument("-P", "--ranks", type=int, default=4)
    p.add_argument("--seq-len", type=int, help="tokens (default 64 per rank)")
    _add_variant_args(p)

    p = sub.add_parser("cost", help="seed 000's analytical cost report, then the time model")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("-P", "--ranks", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True, help="K width per token, all heads")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--bytes-per-element", type=int, default=2)
    _add_time_model_args(p)

    p = sub.add_parser("bench", help="benchmark table under mpiexec -n 1 / -n 2 (see run/bench)")
    from .bench import add_arguments
    add_arguments(p)
    return parser


def _compute_table(plan, records=None):
    """Per-rank work: from the plan, or from what the ranks recorded when ``records`` is given."""
    lines = ["rank  blocks computed  visible pairs  computed pairs"]
    if records is None:
        visible, computed = plan.visible_pairs(), plan.computed_pairs()
        blocks_per_rank = [sum(k != "skip" for k in plan.kinds[r]) for r in range(plan.size)]
    else:
        visible = [rec["visible_pairs"] for rec in records]
        computed = [rec["computed_pairs"] for rec in records]
        blocks_per_rank = [rec["blocks_computed"] for rec in records]
    for r, blocks in enumerate(blocks_per_rank):
        lines.append(f"{r:>4}  {blocks:>15}  {visible[r]:>13}  {computed[r]:>14}")
    lines.append(f"max/mean visible pairs: {max(visible) / (sum(visible) / plan.size):.3f}")
    return "\n".join(lines)


@_register
def schedule(args, comm=None):
    """Print the plan's schedule and per-rank compute."""
    from .schedule import make_plan

    seq_len = args.seq_len or 64 * args.ranks
    plan = make_plan(seq_len, args.ranks, **_variant(args))
    print(f"P={plan.size} seq_len={seq_len} layout={plan.layout} mode={plan.mode} causal={plan.causal} "
          f"window={plan.window} steps={plan.n_steps} messages/rank={plan.messages_per_rank()}")
    print(plan.schedule.format())
    print(_compute_table(plan))
    return 0


@_register
def cost(args, comm=None):
    """Print seed 000's cost report."""
    from .costmodel import ring_attention_context_parallel

    report = ring_attention_context_parallel(args.seq_len, args.ranks, args.hidden, args.heads, args.bytes_per_element)
    for key, value in report.items():
        print(f"{key:>24}: {value}")
    print()
    print(_time_model_text(args))
    return 0


def _time_model_text(args):
    """The time model for ``cost``: head dim and K/V heads from --hidden, --heads and --dim."""
    from .costmodel import PRESETS, Machine, calibrate, format_time_model

    dim = args.dim or args.hidden // args.heads
    if dim < 1 or args.hidden % dim or args.heads % (args.hidden // dim):
        raise ValueError(f"--hidden {args.hidden} must be K/V heads x --dim {dim}, with heads {args.heads} "
                         f"a multiple of the K/V heads")
    machines = [calibrate(head_dim=dim) if name == "this-machine" else PRESETS[name] for name in args.preset]
    if args.flops or args.bandwidth:
        if not (args.flops and args.bandwidth):
            raise ValueError("a custom machine needs both --flops and --bandwidth")
        machines.append(Machine("custom", args.flops, args.latency, args.bandwidth,
                                f"{args.flops / 1e12:g} TFLOP/s, {args.bandwidth / 1e9:g} GB/s, "
                                f"{args.latency * 1e6:g} us"))
    return format_time_model(args.seq_len, args.ranks, heads=args.heads, head_dim=dim, kv_heads=args.hidden // dim,
                             batch=args.batch, bytes_per_element=args.bytes_per_element, machines=machines,
                             causal=args.causal)


@_register
def run(args, comm):
    """Make seeded inputs on rank 0, run the ring, verify and report on rank 0."""
    from threadpoolctl import threadpool_limits

    from .costmodel import calibrate, predicted_bytes_sent, ring_attention_context_parallel
    from .reference import dense_attention
    from .ring import distributed_attention
    from .trace import Progress, format_timeline, timing_report

    threadpool_limits(args.threads)
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    hk = args.kv_heads or args.heads
    variant = _variant(args)
    Q = K = V = None
    if rank == 0:
        rng = np.random.default_rng(args.seed)
        Q = rng.standard_normal((args.batch, args.heads, args.seq_len, args.dim)).astype(dtype)
        K, V = (rng.standard_normal((args.batch, hk, args.seq_len, args.dim)).astype(dtype) for _ in range(2))
    comm.Barrier()
    if args.backward:
        return _run_backward(args, comm, Q, K, V, variant)
    progress = Progress("ring step (rank 0)", enabled={"auto": None, "on": True, "off": False}[args.progress])
    out, sched = distributed_attention(Q, K, V, comm, timeout=args.timeout or None, **variant,
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
    print(_compute_table(plan, records))
    agrees = sched == plan.schedule and [r["visible_pairs"] for r in records] == plan.visible_pairs()
    print(f"recorded schedule equals the plan: {'yes' if agrees else 'NO'}")
    print("\nrank  bytes sent  predicted  messages  compute s  blocked in wait s")
    for r, rec in enumerate(records):
        print(f"{r:>4}  {rec['bytes_sent']:>10}  {predicted[r]:>9}  {rec['messages']:>8}  "
              f"{rec['compute_time']:>9.4f}  {rec['wait_time']:>17.4f}")
    if args.seq_len % size == 0 and plan.mode != "bidirectional":
        seed = ring_attention_context_parallel(args.seq_len, size, hk * args.dim, args.heads, itemsize)
        print(f"cost model (seed 000): total_comm_bytes per rank x batch = {seed['total_comm_bytes'] * args.batch}"
              f" (full ring; windows/documents may stop it early)")
    print(f"\nwall time {wall:.4f} s   attention {flops / wall / 1e9:.2f} GFLOP/s "
          f"(4*B*H*D*visible pairs = {flops / 1e9:.3f} GFLOP)")
    ok = agrees and all(r["bytes_sent"] == p for r, p in zip(records, predicted))
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


# what `run` accepts against the float64 single-process reference
VERIFY_TOL = {np.float64: 1e-10, np.float32: 1e-4}


def _reference_mask(args):
    """Rows a:b of the mask asked for on the command line, from the definitions (``mpiring.reference``).

    Built from the arguments, not from the plan or ``mpiring.masks``: a bug in
    the code under test cannot make its own reference agree with it.
    """
    from .reference import definition_mask

    pos = np.arange(args.seq_len)
    return lambda a, b: definition_mask(pos[a:b], pos, causal=args.causal, window=args.window,
                                        cu_seqlens=args.cu_seqlens)


def _write_trace_and_plot(args, records, title):
    """``run --trace FILE`` and ``--plot FILE`` on rank 0."""
    from .trace import plot_timeline, write_chrome_trace

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


def _run_backward(args, comm, Q, K, V, variant):
    """``run --backward``: forward and backward through the ring, both checked against float64 references."""
    from .backward import distributed_attention_backward, predicted_backward_bytes
    from .costmodel import predicted_bytes_sent
    from .reference import dense_attention, dense_attention_backward

    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = np.dtype(args.dtype)
    dOut = None
    if rank == 0:
        dOut = np.random.default_rng(args.seed + 1).standard_normal(Q.shape).astype(dtype)
    out, dQ, dK, dV, sched = distributed_attention_backward(Q, K, V, dOut, comm, timeout=args.timeout or None,
                                                            return_out=True, **variant)
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
    ok = agrees and all(r["bytes_sent"] == p and r["messages"] == bwd_messages for r, p in zip(records, bwd_bytes))
    ok = ok and all(r["forward"]["bytes_sent"] == p for r, p in zip(records, fwd_bytes))
    if not args.no_verify:
        tol = VERIFY_TOL[dtype.type]
        got = (out, dQ, dK, dV)
        mask = _reference_mask(args)
        want = (dense_attention(Q, K, V, mask=mask)[0],) + dense_attention_backward(dOut, Q, K, V, mask=mask)
        print(f"\nmax abs error vs single-process float64 reference (tolerance {tol:g}):")
        for name, a, b in zip(("out", "dQ", "dK", "dV"), got, want):
            err = float(np.max(np.abs(a - b)))
            ok = ok and err <= tol
            print(f"  {name:>3} {err:.3e}   (max |reference| {float(np.max(np.abs(b))):.3g})")
    _write_trace_and_plot(args, records, f"backward pass: P={size} {plan.layout} {plan.mode}"
                          f"{' causal' if plan.causal else ''}, seq_len={args.seq_len}, H={args.heads} d={args.dim}")
    print("VERIFIED" if ok else "VERIFICATION FAILED")
    return 0 if ok else 1


@_register
def bench(args, comm):
    """Time ring attention and print the benchmark table on rank 0 (mpiring.bench)."""
    from .bench import run as run_bench

    return run_bench(args, comm)


def _abort(comm, code):
    """End the whole job after this rank's last words have left it.

    Abort kills every process at once; the launcher forwards output through a
    pipe, so give it a moment to pass on what this rank just printed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.2)
    comm.Abort(code)


def _abort_hook(comm):
    """An excepthook for anything main() does not catch: print it, then end the whole job."""
    def hook(kind, value, tb):
        sys.__excepthook__(kind, value, tb)
        _abort(comm, 1)
    return hook


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.command not in ("run", "bench"):
        try:
            return COMMANDS[args.command](args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sys.excepthook = _abort_hook(comm)
    try:
        code = COMMANDS[args.command](args, comm)
    except Exception as exc:  # one failing rank must not leave the others waiting forever
        print(f"rank {comm.Get_rank()}: error: {exc}", file=sys.stderr)
        if not isinstance(exc, ValueError):
            traceback.print_exc()
        sys.stderr.flush()
        if comm.Get_size() > 1:
            _abort(comm, 2)
        return 2
    # every rank leaves with rank 0's verdict
    return comm.bcast(code, root=0)


if __name__ == "__main__":
    sys.exit(main())
