"""A plan's cost as text: per-rank work (and per head), the mask's block sparsity, the K/V moves and tokens."""

import numpy as np

from ..plans.rows import visible_per_rank
from ..plans.visibility import count_visible
from .by_strategy import predicted_bytes_sent, strategy_of

__all__ = ["compute_table", "head_table", "sparsity_text", "moves_text"]


def compute_table(plan, records=None):
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
    if records is None and plan.head_pairs is not None:  # over each rank's query tokens (Ulysses: not its work)
        lines.append(head_table(plan.head_pairs, visible_per_rank(plan.seq_len, plan.size, plan.q_owner,
                                                                  plan.mask_options())))
    return "\n".join(lines)


def head_table(head_pairs, union):
    """Per rank, the visible pairs of each (batch entry, head) of its query tokens against their union, which
    the ring modes' kernel visits (``plan.head_pairs``, ``rows.visible_per_rank``); used: the share of the
    visited pairs a head needs."""
    head_pairs, union = np.asarray(head_pairs), np.asarray(union, np.int64)
    per = head_pairs.reshape(len(head_pairs), -1)
    lines = [f"per (batch entry, head): {head_pairs.shape[1]} x {head_pairs.shape[2]}",
             "rank  union pairs  head pairs min     mean      max  used (mean / union)"]
    for r, (u, h) in enumerate(zip(union, per)):
        lines.append(f"{r:>4}  {u:>11}  {h.min():>14}  {h.mean():>7.1f}  {h.max():>7}  {_share(h.mean(), u):>19}")
    lines.append(f"all   {union.sum():>11}  {'':>14}  {per.sum(0).mean():>7.1f}  {'':>7}  "
                 f"{_share(per.sum(0).mean(), union.sum()):>19}")
    lines.append("used by head (over ranks and batch entries): " + " ".join(
        f"{h}:{_share(head_pairs[:, :, h].sum(), head_pairs.shape[1] * union.sum())}"
        for h in range(head_pairs.shape[2])))
    return "\n".join(lines)


def _share(part, whole):
    return f"{part / whole:.3f}" if whole else "-"


CELL = {"full": "#", "masked": "+", "skip": "."}


def sparsity_text(plan, cells=16):
    """The mask's block sparsity in text: the sequence cut into ``cells`` runs of positions (queries down, keys
    across; # every pair visible, + some, . none), then the plan's blocks (query rank down, key rank across)."""
    seq_len, mask = plan.seq_len, plan.mask_options()
    edges = np.linspace(0, seq_len, min(cells, seq_len) + 1).astype(np.int64)
    runs = [np.arange(a, b, dtype=np.int64) for a, b in zip(edges, edges[1:])]
    lines = [f"block sparsity: the sequence in {len(runs)} runs of ~{seq_len // len(runs)} positions "
             f"(# all visible, + some, . none)"]
    for q_run in runs:
        row = ""
        for k_run in runs:
            counts, full = count_visible(q_run, k_run, mask)
            row += CELL["full" if full else "masked" if counts.sum() else "skip"]
        lines.append(f"  {row}")
    lines.append("the ranks' blocks (query rank down, key rank across):")
    lines += [f"  {''.join(CELL[plan.kinds[r][j]] for j in range(plan.size))}" for r in range(plan.size)]
    return "\n".join(lines)


def moves_text(plan):
    """Which K/V block each rank sends where, at which step (``cost.by_strategy``' point-to-point sends), and per
    rank the K/V tokens it sends and those it needs: the other ranks' blocks its queries see (``plan.pieces``)."""
    sends = strategy_of(plan).sends
    lines = ["K/V sends (step: block -> rank):"]
    for r in range(plan.size):
        moves = [f"{step}: {source}->{dest}" for step, dest, source, what in (sends(plan, r) if sends else [])
                 if what == "K/V"]
        lines.append(f"rank {r:>3}  " + (", ".join(moves) or "-"))
    if not sends or plan.size > 1 and not any(sends(plan, r) for r in range(plan.size)):
        lines.append("(no point-to-point sends of blocks: this strategy moves K/V by collectives)")
    sent = predicted_bytes_sent(plan, 1, 1)  # tokens: one element of one byte per token
    needed = [sum(len(plan.kv_shards[j]) for j in range(plan.size) if j != r and plan.pieces(r, j))
              for r in range(plan.size)]
    lines += ["rank  K/V tokens sent  K/V tokens needed from others"]
    lines += [f"{r:>4}  {s:>15}  {n:>29}" for r, (s, n) in enumerate(zip(sent, needed))]
    lines.append(f"total {sum(sent):>14}  {sum(needed):>29}")
    return "\n".join(lines)
