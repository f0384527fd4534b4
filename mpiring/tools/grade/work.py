"""The work checks, causal skipping (exercise 3) and zigzag balance (exercise 4), by counting products.

After the case matrix, the student's function is called once more on the causal ``WORK_SIZE``
float64 case with q, k, v as ``flops.Counted`` arrays, which tally the multiply-adds of every
matrix product made from them. A query-key pair costs 2 H D of them (H D in q k^T, H D in p v),
so each rank's count, divided by 2 H D, is the number of pairs it computed. It is judged against
``mpiring.make_plan(S, P, layout=..., causal=True)``:

- at most ``allowed``: the pairs of the plan's pieces, with the rank's own block taken whole (a
  masked diagonal block computed in full with ``np.tril`` is fine), plus ``SLACK``;
- zigzag: the busiest rank at most ``1 + SLACK`` times the least busy one;
- at least ``plan.visible_pairs()``, the least a ring that makes its products with NumPy can
  compute: a rank counted below it made products the grader could not see (q, k, v turned into
  plain arrays, lists or torch tensors); the check is then "not judged", which does not fail.

The counts are exact and the same on every run: no timing is involved.
"""

from dataclasses import dataclass

import numpy as np

from ... import make_plan
from .cases import run_forward_case
from .exercises import make_cases
from .sync import allgather
from .verdicts import Verdict, ranks_text

__all__ = ["SLACK", "WORK_SIZE", "Work", "allowed_pairs", "counted_runs", "measure_work", "work_verdict"]

WORK_SIZE = "medium"  # the case the work checks count (H, n, D) = (4, 64, 32)
SLACK = 0.1  # extra products allowed over the plan (row sums as products, merges with einsum, ...)


@dataclass
class Work:
    """Per rank: query-key pairs computed (None where nothing returned), and what the plan says."""

    pairs: list
    allowed: list
    visible: list
    block: int  # pairs in one rank's full block, n * n
    problem: str = ""  # why the counts cannot be judged


def allowed_pairs(plan):
    """Per rank: pairs of the plan's pieces, the rank's own block whole."""
    return [sum((p.q1 - p.q0) * (p.k1 - p.k0) for j in range(plan.size) if j != r for p in plan.pieces(r, j))
            + len(plan.shards[r]) ** 2 for r in range(plan.size)]


def counted_runs(exercise, fn, gcomm, opts, causal):
    """Every rank's Run of one call on the WORK_SIZE float64 case with counting arrays, its timeline kept."""
    P = gcomm.Get_size()
    case = next(c for c in make_cases(exercise, P) if c.size == WORK_SIZE and c.dtype == np.float64
                and c.causal == causal)
    run, _ = run_forward_case(case, exercise, fn, gcomm, opts, check_output=False, count=True, events=True)
    return case, allgather(gcomm, run, opts.sync_timeout)


def measure_work(exercise, case, runs, P):
    """Every rank's products on the causal WORK_SIZE case (``counted_runs``) against the plan; returns a Work."""
    h, n, d = case.shape
    plan = make_plan(n * P, P, layout=exercise.layout, causal=True)
    work = Work([None if r.macs is None else r.macs / (2 * h * d) for r in runs], allowed_pairs(plan),
                plan.visible_pairs(), n * n)
    failed = [r for r, other in enumerate(runs) if other.outcome != "returned"]
    if failed:
        first = runs[failed[0]]
        why = first.exception or f"blocked in {first.stuck[0]}"
        work.problem = (f"{ranks_text(failed)} did not return when given the grader's counting arrays (an ndarray "
                        f"subclass), though the cases above passed: {why}")
    elif not any(work.pairs):
        work.problem = ("no matrix product involved q, k or v as the grader gave them: they were converted "
                        "(np.asarray, np.array, tolist, torch) before any product, or the products were not made with "
                        "@ / matmul / dot / einsum / tensordot")
    else:
        short = [r for r in range(P) if work.pairs[r] < work.visible[r]]
        if short:
            r = short[0]
            work.problem = (f"rank {r}'s products that the grader could count cover {work.pairs[r]:.0f} query-key "
                            f"pairs, fewer than the {work.visible[r]} it must see: some products were made on arrays "
                            f"no longer of the grader's counting type (np.asarray, np.array, tolist, torch) or "
                            f"without @ / matmul / dot / einsum / tensordot")
    return work


def _blocks(pairs, block):
    return ", ".join(f"{p / block:.3g}" for p in pairs)


def work_verdict(exercise, work):
    """Causal skipping / zigzag balance from the counted pairs; "not judged" when they could not be counted."""
    if work is None:
        return Verdict("not run")
    if work.problem:
        return Verdict("not judged", "products not counted", [work.problem + "; the work check was not judged"])
    pairs, allowed, block = work.pairs, work.allowed, work.block
    short = f"blocks per rank {_blocks(pairs, block)} (plan {_blocks(allowed, block)})"
    where = (f"query-key pairs per rank, counted from the multiply-adds of your products on the causal {WORK_SIZE} "
             f"float64 case, in blocks of n x n")
    over = [r for r in range(len(pairs)) if pairs[r] > (1 + SLACK) * allowed[r]]
    details, hints = [], []
    if over:
        r = max(over, key=lambda i: pairs[i] / allowed[i])
        details.append(f"{where}: {_blocks(pairs, block)}; the plan computes at most {_blocks(allowed, block)}")
        if exercise.work == "skip":
            needs = f"the blocks of ranks 0 to {r}" if r else "its own block"
            hints.append(("skip", f"rank {r} computed {pairs[r] / block:.3g} blocks where it needs "
                                  f"{allowed[r] / block:.3g} ({needs}): skip the blocks that lie entirely after a "
                                  f"rank's queries"))
        else:
            hints.append(("saved", f"rank {r} computed {pairs[r] / block:.3g} blocks where the plan needs "
                                   f"{allowed[r] / block:.3g}: with zigzag shards each off-diagonal block is half "
                                   f"visible; compute only the visible half"))
    if exercise.work == "balance":
        balance = max(pairs) / max(min(pairs), 1)
        short += f", max/min {balance:.3g}"
        if balance > 1 + SLACK:
            details.append(f"{where}: {_blocks(pairs, block)}, max/min {balance:.3g} > {1 + SLACK:g}")
            hints.append(("balance", "with zigzag shards every rank has the same causal work: compute only the "
                                     "visible half of each off-diagonal block"))
    return Verdict("FAIL" if details else "ok", short, details[:1] if len(details) > 1 else details, hints)
