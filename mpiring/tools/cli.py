"""What the commands of ``python -m mpiring`` share: parsers and option checks, ring variants, MPI waiting."""

import argparse
import os
import time

import numpy as np

from mpiring.plan import ALL_MODES

__all__ = ["command_parser", "add_variant_args", "variant", "mode_text", "at_least", "Agreed", "launch_rank", "poll"]


class Agreed(Exception):  # noqa: N818 (not an error of one rank: the same verdict on every rank)
    """An error that every rank finds alike (a bad option, the library's agreed ValueError).

    ``python -m mpiring`` prints it once, on rank 0, and every rank exits 2:
    nobody is left waiting, so there is nothing to abort.
    """


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (None, a flag that is off)."""

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


def at_least(minimum, **options):
    """A check: each of ``options`` (option name -> attribute) is None or at least ``minimum``."""
    def check(args):
        for name, attr in options.items():
            value = getattr(args, attr)
            if value is not None and value < minimum:
                return f"{name} must be at least {minimum}, got {value}"
        return None
    return check


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


def variant(args):
    """The keyword arguments of ``make_plan`` and the ring that ``add_variant_args`` options ask for."""
    return dict(causal=args.causal, layout=args.layout, mode=args.mode, node_size=args.node_size,
                ulysses_size=args.ulysses_size,
                window=tuple(args.window) if args.window else None,
                cu_seqlens=np.array(args.cu_seqlens) if args.cu_seqlens else None)


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


def poll(requests, timeout=None, what="the other ranks"):
    """Complete MPI ``requests`` by testing them every millisecond, sleeping in between.

    A rank that waits here leaves its core to the ranks still working (a
    blocking MPI wait spins on it), and stays responsive to Ctrl-C. Raises
    TimeoutError after ``timeout`` seconds (None: never).
    """
    from mpi4py import MPI

    start = time.perf_counter()
    while not MPI.Request.Testall(requests):
        if timeout is not None and time.perf_counter() - start > timeout:
            raise TimeoutError(f"waited {timeout:g} s for {what}")
        time.sleep(0.001)
