"""The ``bench`` command: the benchmark table, and every other measurement as a subcommand.

    mpiexec -n 2 python -m mpiring bench --quick          # the table (run/bench runs it at -n 1 and -n 2)
    python -m mpiring bench percore                       # one core, one block
    python -m mpiring bench SUBCOMMAND --help

Each subcommand is a function ``(comm, args=None) -> exit code`` of the module named here, with its
parser ``<name>_parser()``; those that need no MPI get ``comm=None``. docs/performance.md shows what
each one measured.
"""

import importlib

__all__ = ["SUBCOMMANDS", "bench", "bench_parser", "bench_needs_mpi"]

# subcommand: (module of mpiring.tools.bench, needs MPI, what it measures)
SUBCOMMANDS = {
    "table": ("table", True, "throughput, limits, communication, memory, torch beside each row (the default)"),
    "percore": ("micro", False, "one core, one block: the kernel against its own GEMMs and exp2, the limit, torch"),
    "peak": ("probes", False, "this core's peak float32 FMA rate (a small C loop)"),
    "tune": ("micro", False, "time GEMM backends and tiles on this CPU, cache the fastest"),
    "plan": ("micro", False, "one rank's planning time as P grows (docs/performance.md section 13)"),
    "overhead": ("micro", True, "the fixed cost of a call, through the functions and through a Ring"),
    "callcost": ("callcost", True, "a tiny Ring call's fixed cost and its agreement's, beside a bare Iallreduce"),
    "overlap": ("micro", True, "one ring step's transfer alone, then compute and blocked time per step"),
    "accuracy": ("accuracy", False, "error against float64 as P grows, per dtype and accumulation"),
    "zoo": ("traffic", True, "bytes each movement sends for a zoo of masks, against the minimum and the model"),
    "topk": ("traffic", True, "bytes of top-k attention chosen by an indexer against the dense ring"),
    "latent": ("traffic", True, "bytes per token of MLA's latent against per-head K/V"),
    "serving": ("infer", True, "decode, speculative verify and Helix over 64k- and 256k-token caches"),
    "mixers": ("hybrid", True, "conv, gated delta rule, SSD, Mamba-1 on P ranks against transformers' CPU code"),
    "cluster": ("cluster", False, "ring, double ring and Ulysses on the emulated cluster at several link rates"),
}
EPILOG = ("subcommands (python -m mpiring bench SUBCOMMAND --help):\n"
          + "".join(f"  {name:<10}{what}\n" for name, (_, _, what) in SUBCOMMANDS.items()))


def _split(args):
    """``(subcommand, its options)``: no subcommand named is the table."""
    args = list(args or [])
    return (args[0], args[1:]) if args and args[0] in SUBCOMMANDS else ("table", args)


def _module(name):
    return importlib.import_module(f"{__name__}.{SUBCOMMANDS[name][0]}")


def subparser(name):
    """The parser of subcommand ``name``; the table's lists the subcommands too."""
    p = getattr(_module(name), f"{name}_parser")()
    if name == "table":
        p.epilog = EPILOG
    return p


class _Dispatch:
    """``bench``'s parser: the named subcommand's (the table's when none is named)."""

    def parse_args(self, args=None, namespace=None):
        name, rest = _split(args)
        return subparser(name).parse_args(rest, namespace)


def bench_parser():
    return _Dispatch()


def bench_needs_mpi(args):
    return SUBCOMMANDS[_split(args)[0]][1]


def bench(comm, args=None):
    """Run the subcommand ``args`` name (the table when none) on ``comm``."""
    name, rest = _split(args)
    return getattr(_module(name), name)(comm, rest)
