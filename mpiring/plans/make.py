"""``make_plan``: the plan of any strategy, the one entry every caller uses. No MPI.

    python -m mpiring schedule -P 4 --layout zigzag --causal

The ring modes are ``plan.ring_plan``'s. Ulysses (``heads``), the double ring
(``hierarchy``), the sparse movement (``sparse``) and the ring x Ulysses grid (``heads.HybridPlan``) start
from the tokens and masks of the all-gather's ring plan and visit them in
their own order.
"""

from .delivery import sparse_plan
from .heads import hybrid_plan, ulysses_plan
from .hierarchy import double_ring_plan
from .plan import ALL_MODES, Plan, both_ways, gathered, one_way, ring_plan
from .problem import Problem

__all__ = ["make_plan", "RING_MODES", "PLANS"]

# the plan builder's two tables: how each ring mode's blocks move, and the strategies that visit the base
# plan's blocks in their own order (each from the all-gather's plan of the same tokens and masks)
RING_MODES = {"ring": one_way, "bidirectional": both_ways, "allgather": gathered}
PLANS = {"ulysses": lambda base, node_size: ulysses_plan(base),
         "double_ring": lambda base, node_size: double_ring_plan(base, base.size if node_size is None else node_size),
         "sparse": lambda base, node_size: sparse_plan(base)}


def make_plan(seq_len: int, size: int, *, layout: str = "contiguous", mode: str = "ring", causal: bool = False,
              node_size: int | None = None, ulysses_size: int | None = None, **problem) -> Plan:
    """Build the plan for ``size`` ranks over a sequence of ``seq_len`` tokens (keys), in any mode.

    ``layout``, ``causal`` and ``problem`` (``window``, ``cu_seqlens``, ``causal_block``, ``mask``,
    ``positions``, ``kv_positions``, ``q_len``, ``kv_layout``): the fields of ``plans.problem.Problem``;
    every mode holds the same tokens under them (``shard_indices``).
    ``node_size``: ranks per node of the double ring (None: all ranks on one node); other modes ignore it.
    ``ulysses_size``: Ulysses inside groups of that many ranks, the ring mode across them (mpiring.plans.heads).
    """
    if mode not in ALL_MODES:
        raise ValueError(f"mode must be one of {', '.join(ALL_MODES)}; got {mode!r}")
    if ulysses_size is not None:  # a u x (P/u) grid: the ring plan of the groups (mpiring.plans.heads.HybridPlan)
        if mode not in RING_MODES:
            raise ValueError(f"ulysses_size combines with mode ring, bidirectional or allgather, not {mode!r}")
        if isinstance(ulysses_size, bool) or not isinstance(ulysses_size, int) or ulysses_size < 1:
            raise ValueError(f"ulysses_size must be a positive integer, got {ulysses_size!r}")
        if size % ulysses_size:
            raise ValueError(f"ulysses_size {ulysses_size} does not divide the {size} ranks")
    problem = Problem(layout=layout, causal=causal, **problem)
    if mode in RING_MODES and ulysses_size is None:
        return ring_plan(seq_len, size, problem, mode=mode, rounds=RING_MODES[mode])
    # the tokens every rank holds and their masks, as the flat ring's; visited in the strategy's own order
    base = ring_plan(seq_len, size, problem, mode="allgather", rounds=gathered)
    if ulysses_size is not None:
        return hybrid_plan(base, ulysses_size, mode, RING_MODES[mode])
    return PLANS[mode](base, node_size)
