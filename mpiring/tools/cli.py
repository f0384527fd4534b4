"""What the commands of ``python -m mpiring`` share: their parser, and the options that pick a ring variant."""

import argparse

import numpy as np

__all__ = ["command_parser", "add_variant_args", "variant"]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except where there is none to show (None, a flag that is off)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def command_parser(command, func):
    """The parser of ``python -m mpiring <command>``, described by the first line of ``func``'s docstring."""
    return argparse.ArgumentParser(prog=f"python -m mpiring {command}", description=func.__doc__.splitlines()[0],
                                   formatter_class=_HelpFormatter)


def add_variant_args(p):
    """The options that choose the ring: mask, layout, mode, window, packed documents."""
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--layout", default="contiguous", choices=["contiguous", "zigzag", "striped"],
                   help="which tokens each rank holds")
    p.add_argument("--mode", default="ring", choices=["ring", "bidirectional", "allgather"],
                   help="how K/V travel: one way round the ring, both ways, or all-gathered once")
    p.add_argument("--window", type=int, nargs=2, metavar=("LEFT", "RIGHT"), help="sliding window; -1 = unbounded")
    p.add_argument("--cu-seqlens", type=int, nargs="+", metavar="N", help="packed documents: 0 e1 e2 ... seq_len")


def variant(args):
    """The keyword arguments of ``make_plan`` and the ring that ``add_variant_args`` options ask for."""
    return dict(causal=args.causal, layout=args.layout, mode=args.mode,
                window=tuple(args.window) if args.window else None,
                cu_seqlens=np.array(args.cu_seqlens) if args.cu_seqlens else None)
