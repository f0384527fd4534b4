"""The commands that need no MPI: ``schedule`` (the plan) and ``cost`` (the cost report and the time model).

    python -m mpiring schedule -P 4 --layout zigzag --causal
    python -m mpiring schedule -P 4 --frames 16 --frame-tokens 64 --balance greedy
    python -m mpiring cost --seq-len 1048576 -P 8 --hidden 4096 --heads 32 --causal

Each is ``(comm, args=None) -> exit code``; they ignore ``comm`` (pass None).
"""

from mpiring import make_plan
from mpiring.cost.cluster_model import CLUSTERS, format_comparison
from mpiring.cost.costmodel import (
    PRESETS,
    Machine,
    format_time_model,
    format_wire_model,
    ring_attention_context_parallel,
)
from mpiring.cost.infercost import format_inference_model
from mpiring.cost.plantext import compute_table, moves_text, sparsity_text

from .calibrate import calibrate
from .cli import add_variant_args, at_least, balance_table, command_parser, held_positions, mode_text, variant

__all__ = ["schedule", "schedule_parser", "cost", "cost_parser", "held_text"]


def schedule_parser():
    p = command_parser("schedule", schedule)
    p.add_argument("-P", "--ranks", type=int, default=4, help="number of ranks")
    p.add_argument("--seq-len", type=int, help="tokens (default 64 per rank)")
    add_variant_args(p)
    p.add_argument("--moves", action="store_true",
                   help="also which K/V block goes where at which step (the cost model's sends), and the K/V "
                        "tokens each rank sends against those it needs")
    p.checks.append(at_least(1, **{"-P/--ranks": "ranks", "--seq-len": "seq_len"}))
    return p


def schedule(comm=None, args=None):
    """Print the ring schedule and the work of every rank (no MPI needed)."""
    args = schedule_parser().parse_args(args)
    seq_len = args.seq_len or 64 * args.ranks
    plan = make_plan(seq_len, args.ranks, positions=held_positions(args, seq_len, args.ranks), **variant(args))
    print(f"P={plan.size} seq_len={seq_len} {held_text(args, plan)} mode={mode_text(plan)} causal={plan.causal} "
          f"window={plan.window} steps={plan.n_steps} messages/rank={plan.messages_per_rank()}")
    print(plan.schedule.format())
    print(compute_table(plan))
    print(sparsity_text(plan))
    if args.moves:
        print(moves_text(plan))
    if args.balance or args.frames:
        print(balance_table(args, seq_len, args.ranks))
    return 0


def held_text(args, plan):
    """How the tokens are dealt out, for a report's first line (and the frame size of a block-causal mask)."""
    held = f"balance={args.balance}" if args.balance else f"layout={plan.layout}"
    return held + (f" causal_block={plan.causal_block}" if plan.causal_block else "")


def cost_parser():
    p = command_parser("cost", cost)
    p.add_argument("--seq-len", type=int, required=True, help="tokens of the whole sequence")
    p.add_argument("-P", "--ranks", type=int, required=True, help="devices the sequence is split over")
    p.add_argument("--hidden", type=int, required=True, help="K width per token, all heads")
    p.add_argument("--heads", type=int, required=True, help="query heads")
    p.add_argument("--bytes-per-element", type=int, default=2, help="bytes of one element of Q, K, V")
    p.add_argument("--dim", type=int, help="head dim (default hidden / heads); K/V heads = hidden / dim (GQA)")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--causal", action="store_true", help="causal mask (zigzag/striped halve the work per step)")
    p.add_argument("--preset", nargs="+", default=["nvlink", "infiniband"],
                   choices=["nvlink", "infiniband", "10gbe", "this-machine"], help="machines for the time model")
    p.add_argument("--wires", action="store_true", help="also the time model of each K/V wire format (float32, "
                   "bf16, fp16, int8 = FP8's bytes) on every machine: where a smaller wire wins")
    p.add_argument("--flops", type=float, help="a custom machine: FLOP/s (with --bandwidth, --latency)")
    p.add_argument("--bandwidth", type=float, help="custom machine: bytes/s per direction")
    p.add_argument("--latency", type=float, default=10e-6, help="custom machine: seconds per transfer")
    p.add_argument("--cluster", choices=sorted(CLUSTERS), help="also compare ring, double ring and Ulysses on "
                   "nodes of --node-size ranks with two link levels (mpiring.cost.cluster_model)")
    p.add_argument("--node-size", type=int, default=8, help="--cluster: ranks per node (must divide -P)")
    p.add_argument("--new-tokens", type=int, default=1, help="inference model: tokens per decode step")
    p.checks.append(at_least(1, **{"--seq-len": "seq_len", "-P/--ranks": "ranks", "--hidden": "hidden",
                                   "--heads": "heads", "--bytes-per-element": "bytes_per_element", "--dim": "dim",
                                   "--batch": "batch", "--node-size": "node_size", "--new-tokens": "new_tokens"}))
    return p


def cost(comm=None, args=None):
    """Print the analytical cost report of splitting a sequence over P devices, then the time model."""
    args = cost_parser().parse_args(args)
    report = ring_attention_context_parallel(args.seq_len, args.ranks, args.hidden, args.heads, args.bytes_per_element)
    for key, value in report.items():
        print(f"{key:>24}: {value}")
    print()
    print(_time_model_text(args))
    dim, machines = args.dim or args.hidden // args.heads, _machines(args)
    if args.wires:
        print()
        print(format_wire_model(args.seq_len, args.ranks, heads=args.heads, head_dim=dim, kv_heads=args.hidden // dim,
                                batch=args.batch, causal=args.causal, machines=machines))
    if args.cluster:
        if args.ranks % args.node_size:
            raise ValueError(f"--node-size {args.node_size} must divide -P {args.ranks}")
        cluster = CLUSTERS[args.cluster](args.ranks // args.node_size, args.node_size)
        print()
        print(format_comparison(args.seq_len, cluster, causal=args.causal, batch=args.batch, hq=args.heads,
                                hk=args.hidden // dim, dim=dim, dim_v=dim, itemsize=args.bytes_per_element))
    print()
    print(_inference_text(args))
    return 0


def _time_model_text(args):
    """The time model for ``cost``: head dim and K/V heads from --hidden, --heads and --dim."""
    dim = args.dim or args.hidden // args.heads
    if dim < 1 or args.hidden % dim or args.heads % (args.hidden // dim):
        raise ValueError(f"--hidden {args.hidden} must be K/V heads x --dim {dim}, with heads {args.heads} "
                         f"a multiple of the K/V heads")
    return format_time_model(args.seq_len, args.ranks, heads=args.heads, head_dim=dim, kv_heads=args.hidden // dim,
                             batch=args.batch, bytes_per_element=args.bytes_per_element, machines=_machines(args),
                             causal=args.causal)


def _machines(args):
    """The machines of ``--preset`` (this machine calibrated once) and a custom one."""
    if getattr(args, "machines", None) is not None:
        return args.machines
    dim = args.dim or args.hidden // args.heads
    machines = [calibrate(head_dim=dim) if name == "this-machine" else PRESETS[name] for name in args.preset]
    if args.flops or args.bandwidth:
        if not (args.flops and args.bandwidth):
            raise ValueError("a custom machine needs both --flops and --bandwidth")
        machines.append(Machine("custom", args.flops, args.latency, args.bandwidth,
                                f"{args.flops / 1e12:g} TFLOP/s, {args.bandwidth / 1e9:g} GB/s, "
                                f"{args.latency * 1e6:g} us"))
    args.machines = machines
    return machines


def _inference_text(args):
    """The inference model for ``cost``: decode tree vs ring, prefill pass-KV vs pass-Q (``mpiring.cost.infercost``)."""
    dim = args.dim or args.hidden // args.heads
    return format_inference_model(args.seq_len, args.ranks, heads=args.heads, kv_heads=args.hidden // dim,
                                  head_dim=dim, batch=args.batch, bytes_per_element=args.bytes_per_element,
                                  machines=_machines(args), new_tokens=args.new_tokens)
