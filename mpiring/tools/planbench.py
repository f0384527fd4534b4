"""``planbench``: how long one rank takes to plan, as P grows (no MPI): the table of docs/performance.md §13.

    python -m mpiring planbench -P 64 256 1024 4096 --causal --layout zigzag

Per P (one process, CPU time, the best of ``--repeats``): ``make_plan`` for
S = ``--tokens-per-rank`` x P tokens, then what the rank in the middle of
the ring reads of it while it runs: every step's tasks and their pieces (the
ring loop's ``plan.tasks`` and ``plan.pieces``; Ulysses' ``block_pieces``).
"""

import time

from mpiring.core.machine import cpu_model
from mpiring.plans.make import make_plan

from .cli import add_variant_args, command_parser, variant

__all__ = ["planbench", "planbench_parser", "plan_times"]


def planbench_parser():
    p = command_parser("planbench", planbench)
    p.add_argument("-P", "--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096], help="numbers of ranks")
    p.add_argument("--tokens-per-rank", type=int, default=256, help="S = this x P (default 256)")
    p.add_argument("--repeats", type=int, default=3, help="the best of this many (default 3)")
    add_variant_args(p)
    return p


def _best(func, repeats):
    """``(least CPU seconds of ``repeats`` calls, the last result)``."""
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.process_time()
        result = func()
        best = min(best, time.process_time() - start)
    return best, result


def _own_steps(plan, rank):
    """What ``rank`` reads of ``plan`` while it runs: its tasks at every step and their pieces."""
    pieces = 0
    for step in range(plan.n_steps):
        for task in plan.tasks(step, rank):
            pieces += len(plan.block_pieces(task.source) if plan.mode == "ulysses" else plan.pieces(rank, task.source))
    return pieces


def plan_times(size, seq_len, repeats=3, **options):
    """``(make_plan s, one rank's steps s, steps, pieces)`` for ``size`` ranks over ``seq_len`` tokens."""
    made, plan = _best(lambda: make_plan(seq_len, size, **options), repeats)
    own, pieces = _best(lambda: _own_steps(make_plan(seq_len, size, **options), size // 2), repeats)
    return made, max(own - made, 0.0), plan.n_steps, pieces


def planbench(comm=None, args=None):
    """Time one rank's planning as P grows: make_plan, then its own steps (no MPI)."""
    args = planbench_parser().parse_args(args)
    options = variant(args)
    shown = ", ".join(f"{k}={v}" for k, v in options.items() if v not in (None, False) and k != "layout")
    print(f"CPU: {cpu_model()}; layout {args.layout}{', ' + shown if shown else ''}; "
          f"S = {args.tokens_per_rank} x P; CPU seconds, best of {args.repeats}")
    print("| P | S | make_plan s | + one rank's steps s | steps | pieces |")
    print("|---|---|---|---|---|---|")
    for size in args.ranks:
        seq_len = args.tokens_per_rank * size
        made, own, steps, pieces = plan_times(size, seq_len, args.repeats, **options)
        print(f"| {size} | {seq_len} | {made:.4f} | {own:.4f} | {steps} | {pieces} |", flush=True)
    return 0
