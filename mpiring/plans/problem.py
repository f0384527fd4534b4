"""``Problem``: which tokens each rank holds and which keys each query sees, as the plan builders take it. No MPI."""

from dataclasses import dataclass

__all__ = ["Problem"]


@dataclass(frozen=True, eq=False)
class Problem:
    """Which tokens each rank holds and which keys each query sees: what ``make_plan`` and ``ring_plan`` plan.

    ``positions``: one integer array per rank, the global positions of its
    query (and key/value) rows in the order it passes them; together a
    partition of range(seq_len). Replaces ``layout``. ``kv_positions``: the
    key/value rows' when they are not the queries' (a partition of
    range(seq_len)); the query positions are then distinct positions of that
    range. ``causal_block=F`` (with ``causal``): key j is visible to query i
    iff j // F <= i // F. ``mask``: more pieces (``visibility.MaskPiece``),
    all of which must allow a key. ``q_len``, ``kv_layout``: cross-attention,
    queries of a sequence of their own (``plans.cross``).
    """

    layout: str = "contiguous"
    causal: bool = False
    window: tuple[int, int] | None = None
    cu_seqlens: object = None
    causal_block: int | None = None
    mask: tuple = ()
    positions: object = None
    kv_positions: object = None
    q_len: int | None = None
    kv_layout: str | None = None
