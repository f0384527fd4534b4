"""The work checks: causal skipping (exercise 3) and zigzag balance (exercise 4)."""

import numpy as np

from .cases import Case, run_forward_case
from .sync import allgather
from .verdicts import Verdict

__all__ = ["measure_work", "work_verdict"]

WORK_SIZE = "large"  # the case whose compute time the work checks measure
# Thresholds of the work checks. Measured with the solutions on a 2-core machine (least of 3 runs):
# rank 0 / rank P-1 is about 0.7 at P = 2 (the masked diagonal block costs more than a full one)
# and 0.3 at P = 4, against 1.0 or more without skipping; zigzag max/min about 1.0-1.2, and causal /
# non-causal work 0.7-0.8, against about 1.5 without skipping.
SKIP_RATIO = 0.9
BALANCE_RATIO = 1.4
SAVED_RATIO = 0.95

WORK_REPEATS = 3  # the work checks take each rank's least CPU time over this many calls


def measure_work(exercise, fn, gcomm, opts):
    """{causal: [CPU seconds per rank]} of the 'large' float64 case, the least of WORK_REPEATS calls.

    CPU time outside the calls made through comm, with one BLAS thread: the work a rank did,
    whoever else shared its core. None if a call did not return on every rank.
    """
    cpu = {}
    for causal in (True,) if exercise.work == "skip" else (True, False):
        case = Case(WORK_SIZE, np.float64, causal, seed=999)
        for _ in range(WORK_REPEATS):
            run, _ = run_forward_case(case, exercise, fn, gcomm, opts, check_output=False)
            runs = allgather(gcomm, run, opts.sync_timeout)
            if any(r.outcome != "returned" for r in runs):
                return None
            times = [r.cpu for r in runs]
            cpu[causal] = times if causal not in cpu else [min(a, b) for a, b in zip(cpu[causal], times)]
    return cpu


def work_verdict(exercise, cpu, P):
    """Causal skipping / zigzag balance, from the CPU time per rank of the causal (and non-causal) 'large' case."""
    if cpu is None:
        return Verdict("not run")
    if P == 1:
        return Verdict("ok", "one rank: nothing to compare")
    causal = cpu[True]
    shown = ", ".join(f"{c:.3f}" for c in causal)
    where = f"CPU s per rank, causal {WORK_SIZE} float64 case, least of {WORK_REPEATS} runs"
    if exercise.work == "skip":
        ok = causal[0] <= SKIP_RATIO * causal[-1]
        short = f"rank 0 {causal[0]:.3f} s, rank {P - 1} {causal[-1]:.3f} s"
        details = [] if ok else [f"compute time ({where}): {shown}"]
        hints = [] if ok else [("skip", f"rank 0 needs 1 block and rank {P - 1} all {P}, yet rank 0 computed "
                                        f"{causal[0] / causal[-1]:.2f} x as long (skipping gives about 1/P plus "
                                        f"the cost of the mask): skip the blocks that lie entirely after a "
                                        f"rank's queries")]
        return Verdict("ok" if ok else "FAIL", short, details, hints)
    balance = max(causal) / max(min(causal), 1e-9)
    saved = sum(causal) / max(sum(cpu[False]), 1e-9)
    # at P = 2 the masked diagonal block is half the work: the saving is too small to tell from noise
    ok = balance <= BALANCE_RATIO and (saved <= SAVED_RATIO or P < 3)
    short = f"max/min {balance:.2f}, causal/non-causal {saved:.2f}" + (" (not judged at P = 2)" if P < 3 else "")
    details, hints = [], []
    if balance > BALANCE_RATIO:
        details.append(f"compute time ({where}): {shown}, max/min {balance:.2f} > {BALANCE_RATIO}")
        hints.append(("balance", "with zigzag shards every rank has the same causal work: compute only the visible "
                                 "half of each off-diagonal block"))
    if saved > SAVED_RATIO and P >= 3:
        details.append(f"causal work is {saved:.2f} x the non-causal work (> {SAVED_RATIO})")
        hints.append(("saved", "a causal zigzag ring computes about half as much as a non-causal one, plus the "
                               "masked diagonal blocks: skip what is masked"))
    return Verdict("ok" if ok else "FAIL", short, details, hints)
