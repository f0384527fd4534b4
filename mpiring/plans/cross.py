"""Cross-attention's rows: queries of one sequence over the keys/values of another, each laid out over the ranks
by its own layout. No MPI.

    spec = Spec.of(seq_len=4096, kv_seq_len=1024, layout="zigzag", kv_layout="contiguous")

The plan's ``seq_len`` is the keys' (as everywhere: ``kv_positions`` too gives
key rows of their own), ``q_len`` the queries'. A mask compares a query's and
a key's position as they are, each in its own sequence (flex-attention's
``q_idx``, ``kv_idx``): ``causal`` keeps key j for query i iff j <= i. Every
strategy follows from the two lists of positions (``shards``, ``kv_shards``),
as it does for ``kv_positions``.
"""

from .layouts import check_layout, shard_indices
from .rows import Rows

__all__ = ["check_cross", "cross_rows"]


def check_cross(q_len, size, positions, kv_positions, cu_seqlens, kv_layout):
    """Raise ValueError if cross-attention of ``q_len`` queries cannot take these options (None: not cross)."""
    if q_len is None:
        if kv_layout is not None:
            raise ValueError("kv_layout is cross-attention's: it needs kv_seq_len")
        return
    if kv_layout is not None:
        check_layout(kv_layout)
    if q_len < size:
        raise ValueError(f"need at least one query per rank: {q_len} queries (seq_len), ranks={size}")
    if (positions is None) != (kv_positions is None):
        raise ValueError("cross-attention's positions= and kv_positions= come together (each over its own "
                         "sequence)")
    if cu_seqlens is not None:
        raise ValueError("cu_seqlens packs documents of one sequence; cross-attention (kv_seq_len) has two: give "
                         "the rule as a mask function of (q_pos, k_pos)")


def cross_rows(plan, q_len, kv_layout, layouts):
    """Make ``plan`` cross-attention's: ``q_len`` queries; ``layouts``: the rows from the layouts (``layout`` for
    the queries, ``kv_layout`` for the keys), else the positions the plan was given."""
    plan.q_len, plan.kv_layout = int(q_len), kv_layout or plan.layout
    if layouts:
        size, seq_len = plan.size, plan.seq_len
        plan.shards = Rows(size, lambda r: shard_indices(plan.q_len, size, r, plan.layout))
        plan.kv_shards = Rows(size, lambda r: shard_indices(seq_len, size, r, plan.kv_layout))
        plan.kv_orders = [None] * size
