"""Command line: ``python -m mpiring run|schedule|cost``.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal
    python -m mpiring schedule -P 4 --layout zigzag --causal
    python -m mpiring cost --seq-len 1048576 -P 8 --hidden 4096 --heads 32

Each subcommand is a function ``(args, comm) -> exit code`` that prints on rank 0 only.
"""

import argparse
import sys
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
    p.add_argument("--timeout", type=float, help="seconds a rank may wait for a transfer")
    p.add_argument("--no-verify", action="store_true", help="skip the single-process reference")
    _add_variant_args(p)

    p = sub.add_parser("schedule", help="print the ring schedule (no MPI needed)")
    p.add_argument("-P", "--ranks", type=int, default=4)
    p.add_argument("--seq-len", type=int, help="tokens (default 64 per rank)")
    _add_variant_args(p)

    p = sub.add_parser("cost", help="seed 000's analytical cost report")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("-P", "--ranks", type=int, required=True)
    p.add_argument("--hidden", type=int, required=True, help="K width per token, all heads")
    p.add_argument("--heads", type=int, required=True)
    p.add_argument("--bytes-per-element", type=int, default=2)
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
    return 0


@_register
def run(args, comm):
    """Make seeded inputs on rank 0, run the ring, verify and report on rank 0."""
    from threadpoolctl import threadpool_limits

    from .costmodel import predicted_bytes_sent, ring_attention_context_parallel
    from .kernels import reference_attention
    from .masks import visible_keys
    from .ring import distributed_attention

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
    out, sched = distributed_attention(Q, K, V, comm, timeout=args.timeout, **variant)
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
        pos = np.arange(args.seq_len)
        klo, khi = visible_keys(pos, pos, causal=plan.causal, window=plan.window, cu_seqlens=plan.cu_seqlens)
        ref, _ = reference_attention(Q, K, V, klo=klo, khi=khi)
        err = float(np.max(np.abs(out - ref)))
        tol = 1e-10 if dtype == np.float64 else 1e-4
        ok = ok and err <= tol
        print(f"max abs error vs single-process float64 reference: {err:.3e} (tolerance {tol:g})")
    print("VERIFIED" if ok else "VERIFICATION FAILED")
    return 0 if ok else 1


def main(argv=None):
    args = _parser().parse_args(argv)
    if args.command != "run":
        try:
            return COMMANDS[args.command](args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        code = COMMANDS[args.command](args, comm)
    except Exception as exc:  # one failing rank must not leave the others waiting forever
        print(f"rank {comm.Get_rank()}: error: {exc}", file=sys.stderr)
        if not isinstance(exc, ValueError):
            traceback.print_exc()
        sys.stderr.flush()
        if comm.Get_size() > 1:
            comm.Abort(2)
        return 2
    # every rank leaves with rank 0's verdict
    return comm.bcast(code, root=0)


if __name__ == "__main__":
    sys.exit(main())
