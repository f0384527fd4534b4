"""The sparse movement (``mode="sparse"``): each K/V block goes straight from its owner to the ranks needing it. No MPI.

    python -m mpiring schedule -P 4 --mode sparse --causal --window 2 0

The flat ring forwards every block along the ring up to the farthest offset
some rank needs (``plan.reach``), so under sliding windows, packed documents
and block-causal frames blocks travel to ranks that never use them, and
through ranks that do not need them. Here the graph of needed blocks decides
every transfer: rank r needs source j != r iff ``plan.pieces(r, j)`` is not
empty (the plan's pieces are the only source of truth, whatever mask made
them). At the start every rank posts the receives of the blocks it needs and
sends its own block to each rank that needs it; it computes its own block
while they travel, then each needed block as it arrives, in ring order (the
nearest source first). Backward: K/V move the same way, and each user sends
its dK/dV partial of a block straight home as soon as that block is done; the
owner adds them up in the order of the users' ranks.

Under a mask that asks for it (a piece with ``sparse_keys``: the top-k
selection, ``plans.indexer``), only the keys of a block that some query of the
receiving rank sees travel (``kept``), and only their dK/dV partial comes home.

Each rank receives exactly the blocks it needs, once: the minimum. Never more
bytes than the ring with its early stop (a block the ring brings to a rank at
offset s is sent there once, and only if that rank needs it), often far
fewer; the price is memory (a rank holds every block it needs at once, as the
all-gather holds all of them) and more, smaller messages at once.
"""

from dataclasses import dataclass

import numpy as np

from ..core.scores import allowed_rows
from .plan import Plan, PlannedSchedule, Task, problem_fields
from .rows import PairTable, Rows

__all__ = ["SparsePlan", "sparse_plan"]

KV, GRADS = "K/V", "dK/dV home"  # what a send carries, as the cost model's ``sends`` name it


@dataclass
class SparsePlan(Plan):
    """A ring plan's shards and masks; every block sent once to each rank that needs it (``needs``, ``users``)."""

    needs: Rows | None = None  # needs[r]: the other ranks whose blocks r needs, nearest ring offset first
    users: Rows | None = None  # users[j]: the other ranks that need j's block, in rank order
    keys: PairTable | None = None  # keys[r][j]: the rows of j's block that travel to r (None: whole blocks)

    def kept(self, rank, source):
        """The sorted rows of ``source``'s block that travel to ``rank``; None: all of them (``keys``)."""
        return None if self.keys is None or rank == source else self.keys[rank][source]

    def tokens(self, rank, source):
        """K/V tokens of ``source``'s block that ``rank`` receives (and whose dK/dV partial it sends home)."""
        rows = self.kept(rank, source)
        return len(self.kv_shards[source]) if rows is None else len(rows)

    def pieces(self, rank, source, rows=None):
        """``Plan.pieces`` over the keys that travel to ``rank`` (``kept``), indexed as they arrive."""
        return super().pieces(rank, source, self.kept(rank, source) if rows is None else rows)

    def sends(self, rank, backward=False):
        """``[(step, dest, source, what)]``: ``rank``'s own block to each user at step 0; backward also the dK/dV
        partial of each block it needed, home, at the step it computes it."""
        out = [(0, dest, rank, KV) for dest in self.users[rank]]
        if backward:
            out += [(step, source, source, GRADS) for step, source in enumerate(self.needs[rank], 1)]
        return out

    def steps_of(self, rank):
        return 1 + len(self.needs[rank])  # its own block, then each it needs

    def messages_of(self, rank, backward=False):
        return 2 * len(self.sends(rank, backward))  # K and V (dK and dV) are separate messages

    def messages_per_rank(self):
        """The most point-to-point sends of any rank (``messages_of`` gives each rank's)."""
        return max(self.messages_of(r) for r in range(self.size))

    def backward_messages_per_rank(self):
        return max(self.messages_of(r, backward=True) for r in range(self.size))

    def moved_tokens(self):
        """Per rank: K/V tokens it receives (the sum of its needed blocks' lengths, each once)."""
        return [sum(self.tokens(r, j) for j in self.needs[r]) for r in range(self.size)]


def sparse_plan(base):
    """The sparse movement over the shards and masks of ``base`` (a ring plan of the same options).

    A rank finds what it needs (``needs``: its row of pieces) and who needs its block (``users``: its
    column) in O(P) pairs, made when first read, as the ring's plan finds a rank's own steps.
    """
    size = base.size
    plan = SparsePlan(**problem_fields(base), mode="sparse", rounds={})
    needed = lambda r, j: Plan.pieces(plan, r, j)  # noqa: E731 (any visible pair of r's queries in j's block)
    plan.needs = Rows(size, lambda r: [j for s in range(1, size) for j in [(r - s) % size] if needed(r, j)])
    plan.users = Rows(size, lambda j: [r for r in range(size) if r != j and needed(r, j)])
    if any(piece.sparse_keys for piece in plan.mask_pieces):
        plan.keys = PairTable(size, lambda r, j: (_seen(plan, r, j),), 0)

    def tasks(step, rank):
        if step == 0:
            return (Task(rank, plan.kinds[rank][rank]),)
        needs = plan.needs[rank]
        return (Task(needs[step - 1], plan.kinds[rank][needs[step - 1]]),) if step <= len(needs) else ()

    plan.schedule = _Schedule(plan, tasks)
    return plan


def _seen(plan, rank, source):
    """The rows of ``source``'s block that some query of ``rank`` sees, from the mask's definition."""
    where = plan.where(rank, source)
    seen = np.zeros(len(where.k_pos), bool)
    if plan.kinds[rank][source] == "skip":
        return np.flatnonzero(seen)
    n, m = len(where.q_pos), len(where.k_pos)
    for _, _, ok in allowed_rows(where.mask, where.q_pos, where.k_pos, np.zeros(n, np.int64), np.full(n, m)):
        seen |= ok.reshape(-1, m).any(axis=0)
    return np.flatnonzero(seen)


class _Schedule(PlannedSchedule):
    """The sparse plan's schedule: ``n_steps``, the longest rank's, made when first read (it reads every rank's
    row: P x P pairs); a rank that runs reads only its own steps (``SparsePlan.steps_of``)."""

    def __init__(self, plan, tasks):
        super().__init__(None, plan.size, tasks)
        self._plan = plan

    @property
    def n_steps(self):
        if self._n_steps is None:
            self._n_steps = max(self._plan.steps_of(r) for r in range(self._plan.size))
        return self._n_steps
