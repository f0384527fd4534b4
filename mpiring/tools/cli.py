"""What the commands of ``python -m mpiring`` share: parsers and option checks, ring variants, MPI waiting."""

import argparse
import functools
import math
import os
import time

import numpy as np
from threadpoolctl import threadpool_limits

from mpiring.masks import parse as parse_mask
from mpiring.plans.balancers import METHODS, balance, imbalance, work
from mpiring.plans.plan import ALL_MODES

__all__ = ["command_parser", "with_threads", "heads_problem", "add_variant_args", "variant", "mode_text", "video",
           "held_positions", "balance_table", "at_least", "Agreed", "launch_rank", "poll", "objects", "on_rank0",
           "table_text"]


class Agreed(Exception):  # noqa: N818 (not an error of one rank: the same verdict on every rank)
    """An error that every rank finds alike (a bad option, the library's agreed ValueError).

    ``python -m mpiring`` prints it once, on rank 0, and every rank exits 2:
    nobody is left waiting, so there is nothing to abort.
    """


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (None, a flag that is off); the epilog as written."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that also checks values: ``checks`` are functions ``args -> problem or None``.

    A problem is reported like any argparse error (usage, the message, exit 2),
    before the command does anything.
    """

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.checks = []

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        for check in self.checks:
            problem = check(parsed)
            if problem:
                self.error(problem)
        return parsed


def command_parser(command, func):
    """The parser of ``python -m mpiring <command>``, described by the first line of ``func``'s docstring."""
    return CommandParser(prog=f"python -m mpiring {command}", description=func.__doc__.splitlines()[0],
                         formatter_class=_HelpFormatter)


def with_threads(parser, user_api=None):
    """A command ``(comm, args=None)`` whose body runs with ``--threads`` BLAS threads, the caller's restored
    after: a command called as a function (as tests do) leaves the process as it found it (the BLAS thread
    count picks the kernels' GEMM library, ``core.tuning.gemm.product``, so it changes results' last bits)."""
    def wrap(body):
        @functools.wraps(body)
        def command(comm, args=None):
            args = parser().parse_args(args)
            with threadpool_limits(args.threads, user_api=user_api):
                return body(comm, args)
        return command
    return wrap


def at_least(minimum, **options):
    """A check: each of ``options`` (option name -> attribute) is None or at least ``minimum``."""
    def check(args):
        for name, attr in options.items():
            value = getattr(args, attr)
            if value is not None and value < minimum:
                return f"{name} must be at least {minimum}, got {value}"
        return None
    return check


def heads_problem(args):
    """A check: grouped-query ``--kv-heads`` must divide ``--heads``."""
    if args.kv_heads and args.heads % args.kv_heads:
        return f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}"
    return None


def add_variant_args(p):
    """The options that choose the ring: mask, layout, mode, window, packed documents."""
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag", "striped"],
                   help="which tokens each rank holds")
    p.add_argument("--mode", default="ring", choices=list(ALL_MODES),
                   help="how K/V travel: one way round the ring, both ways, all-gathered once, or an inner ring per "
                        "node and an outer ring across nodes (double_ring); or ulysses: heads travel "
                        "(all-to-all), every rank attends its heads over the whole sequence")
    p.add_argument("--node-size", type=int, metavar="N",
                   help="double_ring: ranks per node (default: as MPI places them; schedule: all on one node)")
    p.add_argument("--ulysses-size", type=int, metavar="U",
                   help="ring x Ulysses: Ulysses inside groups of U ranks, the ring mode across the groups")
    p.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="sliding window; -1 = unbounded")
    p.add_argument("--cu-seqlens", type=int, nargs="+", metavar="N", help="packed documents: 0 e1 e2 ... seq_len")
    p.add_argument("--causal-block", type=int, nargs="?", const=0, metavar="F",
                   help="block-causal mask (with --causal): key j visible to query i iff j // F <= i // F; "
                        "no value: F = --frame-tokens")
    p.add_argument("--mask", metavar="TEXT",
                   help="more mask pieces (mpiring.masks.parse): causal, prefix:N, frames:F, window:L,R, "
                        "documents:0,E1,...,S joined by & and |, e.g. 'causal|prefix:64'")
    p.add_argument("--balance", choices=METHODS, metavar="METHOD",
                   help=f"positions from mpiring.balance ({', '.join(METHODS)}) instead of --layout; prints every "
                        f"method's per-rank work side by side")
    p.add_argument("--frames", type=int, help="video: --frames x --frame-tokens tokens, frame-causal "
                   "(sets --seq-len, --causal and --causal-block)")
    p.add_argument("--frame-tokens", type=int, default=512, help="video: tokens per frame")
    p.checks += [at_least(1, **{"--frames": "frames", "--frame-tokens": "frame_tokens"}), video, _mask_check]


def add_score_args(p):
    """The score modifiers' options (``run``): --softcap, --sinks, --dropout (docs/masks.md)."""
    p.add_argument("--softcap", type=float, metavar="C", help="logits become C * tanh(logits / C)")
    p.add_argument("--sinks", type=float, nargs="+", metavar="LOGIT",
                   help="attention sinks: one logit per query head (or one for all), once in each row's denominator")
    p.add_argument("--dropout", type=float, default=0.0, metavar="P",
                   help="attention dropout with probability P (its generator keyed by --seed)")


def score_options(args):
    """The score options of ``--softcap``, ``--sinks`` (one value: every head's) and ``--dropout``."""
    sinks = args.sinks
    if sinks is not None and len(sinks) == 1:
        sinks = sinks * args.heads
    return dict(softcap=args.softcap, sinks=None if sinks is None else np.array(sinks), dropout=args.dropout,
                seed=args.seed if args.dropout else 0)


def _mask_check(args):
    """``--mask``: the pieces it names, parsed once (``args.mask_pieces``); a check (None: fine)."""
    args.mask_pieces = ()
    if args.mask:
        try:
            args.mask_pieces = (parse_mask(args.mask),)
        except ValueError as exc:
            return f"--mask: {exc}"
    return None


def video(args):
    """``--frames``: the sequence is frames x frame tokens, frame-causal; a check (None: fine)."""
    if args.frames:
        args.seq_len, args.causal = args.frames * args.frame_tokens, True
        args.causal_block = args.causal_block or args.frame_tokens
    elif args.causal_block == 0:
        args.causal_block = args.frame_tokens
    if args.causal_block is not None and args.causal_block < 1:
        return f"--causal-block must be at least 1, got {args.causal_block}"
    return None


def variant(args):
    """The keyword arguments of ``make_plan`` and the ring that ``add_variant_args`` options ask for."""
    return dict(causal=args.causal, layout=args.layout, mode=args.mode, node_size=args.node_size,
                ulysses_size=args.ulysses_size,
                window=tuple(args.window) if args.window else None,
                cu_seqlens=np.array(args.cu_seqlens) if args.cu_seqlens else None, causal_block=args.causal_block,
                mask=getattr(args, "mask_pieces", ()))


def _mask(args):
    options = variant(args)
    return {name: options[name] for name in ("causal", "window", "cu_seqlens", "causal_block", "mask")}


def held_positions(args, seq_len, size):
    """Every rank's positions under ``--balance`` (None: the --layout)."""
    return None if args.balance is None else balance(seq_len, size, method=args.balance, **_mask(args))


def balance_table(args, seq_len, size):
    """Every balancer's per-rank work (visible pairs) side by side, and max/mean; the chosen one marked."""
    mask = _mask(args)
    loads = {m: work(balance(seq_len, size, method=m, **mask), seq_len, **mask) for m in METHODS}
    names = [m + ("*" if m == args.balance else "") for m in METHODS]
    lines = [f"visible pairs per rank, by balancer (mpiring.balance{'; * = this run' if args.balance else ''}):",
             "rank" + "".join(f"{n:>14}" for n in names)]
    lines += [f"{r:>4}" + "".join(f"{loads[m][r]:>14}" for m in METHODS) for r in range(size)]
    lines.append("max/mean" + "".join(f"{imbalance(loads[m]):>14.3f}" for m in METHODS)[4:])
    return "\n".join(lines)


def mode_text(plan):
    """The plan's mode as reports show it, with the double ring's node size or the grid's Ulysses size."""
    if plan.mode == "double_ring":
        return f"{plan.mode} node_size={plan.node_size}"
    size = getattr(plan, "ulysses_size", None)
    return f"{plan.mode} ulysses_size={size}" if size else plan.mode


# where launchers put a process's rank before MPI starts: MPICH/Hydra and PMI-2, Open MPI, PMIx, Slurm
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")


def launch_rank(environ=None):
    """This process's rank as its launcher announced it (0 when none did), known before MPI starts."""
    environ = os.environ if environ is None else environ
    for name in RANK_VARIABLES:
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def poll(requests, timeout=None, what="the other ranks", spin=False):
    """Complete MPI ``requests`` by testing them every millisecond, sleeping in between (``spin``: testing
    without a pause, for a barrier that starts a timing).

    A rank that waits here leaves its core to the ranks still working (a
    blocking MPI wait spins on it), and stays responsive to Ctrl-C: a rank
    held in a blocking collective never runs its SIGINT handler, and the
    ranks that did would wait for it in MPI_Finalize. Raises TimeoutError
    after ``timeout`` seconds (None: never).
    """
    from mpi4py import MPI

    from mpiring.mpi.waits import polls

    start = time.perf_counter()
    for now in polls(lambda: MPI.Request.Testall(requests), naps=(1e-3, 1e-3), spin=math.inf if spin else 0.0):
        if timeout is not None and now - start > timeout:
            raise TimeoutError(f"waited {timeout:g} s for {what}")


def barrier(comm, spin=False):
    """``comm.Barrier()`` waited for in a polling loop (see ``poll``)."""
    poll([comm.Ibarrier()], spin=spin)


def broadcast(comm, obj):
    """``comm.bcast(obj, root=0)`` waited for in a polling loop: rank 0's ``obj`` on every rank."""
    return objects(comm, obj if comm.Get_rank() == 0 else None)[0]


def objects(comm, obj, root=None, timeout=None, what="the other ranks"):
    """Every rank's ``obj`` (pickled), waited for in a polling loop: the list on every rank, or with ``root``
    on that rank only (None on the others)."""
    from mpiring.mpi.collectives import pickled, unpickled

    data = pickled(obj)
    here = root is None or comm.Get_rank() == root
    sizes = np.empty(comm.Get_size(), np.int64) if here else None
    count = np.array([data.size], np.int64)
    if root is None:
        poll([comm.Iallgather(count, sizes)], timeout, what)
        flat = np.empty(int(sizes.sum()), np.uint8)
        poll([comm.Iallgatherv(data, [flat, sizes])], timeout, what)
    else:
        poll([comm.Igather(count, sizes, root=root)], timeout, what)
        flat = np.empty(int(sizes.sum()), np.uint8) if here else None
        poll([comm.Igatherv(data, [flat, sizes] if here else None, root=root)], timeout, what)
    return unpickled(flat, sizes) if here else None


def on_rank0(comm, work, otherwise=None):
    """``work()`` on rank 0 while the other ranks sleep, their cores left to it: its result on rank 0,
    ``otherwise`` on the others."""
    result = work() if comm.Get_rank() == 0 else otherwise
    poll([comm.Ibarrier()])
    return result


def table_text(head, rows, markdown=False, left=False, indent=""):
    """Rows of cells as text: columns aligned to their widest cell (right, or ``left``), or a Markdown table."""
    rows = [[str(c) for c in row] for row in [head, *rows]]
    if markdown:
        return "\n".join("| " + " | ".join(r) + " |" for r in [rows[0], ["---"] * len(head), *rows[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join(indent + "  ".join(c.ljust(w) if left else c.rjust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows)
