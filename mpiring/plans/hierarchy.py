"""The double ring (``mode="double_ring"``): an inner ring inside each node, an outer ring across nodes. No MPI.

    python -m mpiring schedule -P 4 --mode double_ring --node-size 2 --causal

P ranks form m nodes of n consecutive ranks (``node_size=n``); rank r is
local rank l = r mod n of node a = r div n. The P steps form m rounds of n
inner steps. At round o, inner step i, rank (a, l) holds the K/V block of
rank (a - o, l - i) (node and local rank taken mod m and mod n)::

    inner: every step but a round's last, the held block goes to (a, l + 1): inside the node
    outer: at a round's first step, the round's first block goes to (a + 1, l): between nodes

so a slow transfer between nodes has a whole round of n blocks' compute to
hide behind, instead of the one block of a flat ring (LoongTrain's double
ring; Megatron's hierarchical context parallelism). Every block visits every
rank once, as in the flat ring.

Backward: a block's dK/dV partial follows it round its node's inner ring one
step behind, and the node's last visitor sends it home, so each block's owner
adds up m partials, one per node (its own node's too).
"""

from dataclasses import dataclass

from .plan import NEXT, Plan, PlannedSchedule, Task, problem_fields

__all__ = ["DoubleRingPlan", "double_ring_plan", "INNER", "OUTER"]

INNER, OUTER = "intra-node", "inter-node"  # the two links, as Record's send events name them


@dataclass
class DoubleRingPlan(Plan):
    """A ring plan's shards and masks, visited in the double ring's order."""

    node_size: int = 1

    @property
    def nodes(self):
        return self.size // self.node_size

    def place(self, rank):
        """``(node, local rank)`` of ``rank``."""
        return divmod(rank, self.node_size)

    def rank_at(self, node, local):
        return (node % self.nodes) * self.node_size + local % self.node_size

    def round_step(self, step):
        """``(round, inner step)`` of ``step``."""
        return divmod(step, self.node_size)

    def source_at(self, rank, step):
        """Whose block ``rank`` holds at ``step``."""
        (a, loc), (o, i) = self.place(rank), self.round_step(step)
        return self.rank_at(a - o, loc - i)

    def inner_next(self, rank, ahead=1):
        a, loc = self.place(rank)
        return self.rank_at(a, loc + ahead)

    def outer_next(self, rank, ahead=1):
        a, loc = self.place(rank)
        return self.rank_at(a + ahead, loc)

    def last_visitor(self, source, rnd):
        """The rank that holds ``source``'s block last in round ``rnd`` (on node source's + rnd): it sends it home."""
        a, loc = self.place(source)
        return self.rank_at(a + rnd, loc + self.node_size - 1)

    def sends(self, rank, backward=False):
        """``[(step, dest, source, what, link)]``: every block (or partial) ``rank`` sends, in order.

        ``what``: "K/V", "dK/dV" (a partial onward) or "dK/dV home"; ``link``: INNER or OUTER.
        """
        n, m = self.node_size, self.nodes
        out = []
        for step in range(self.size):
            o, i = self.round_step(step)
            held = self.source_at(rank, step)
            if i == 0 and o < m - 1:
                out.append((step, self.outer_next(rank), held, "K/V", OUTER))
            if i < n - 1:
                out.append((step, self.inner_next(rank), held, "K/V", INNER))
            if backward and i < n - 1:
                out.append((step, self.inner_next(rank), held, "dK/dV", INNER))
            if backward and i == n - 1 and held != rank:
                same = self.place(held)[0] == self.place(rank)[0]
                out.append((step, held, held, "dK/dV home", INNER if same else OUTER))
        return out

    def messages_per_rank(self):
        return 2 * (self.size - 1)  # K and V of every block but the own, as the flat ring

    def backward_messages_per_rank(self):
        return 2 * len(self.sends(0, backward=True))  # the same count on every rank: K and V (dK and dV) each


def double_ring_plan(base, node_size):
    """The double ring over the shards and masks of ``base`` (a ring plan of the same options), n = ``node_size``."""
    if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
        raise ValueError(f"node_size must be a positive integer (ranks per node), got {node_size!r}")
    if base.size % node_size:
        raise ValueError(f"node_size {node_size} does not divide the {base.size} ranks into whole nodes")
    fields = problem_fields(base)
    plan = DoubleRingPlan(**fields, mode="double_ring", rounds={NEXT: base.size - 1}, node_size=node_size)
    def tasks(step, rank):
        source = plan.source_at(rank, step)
        return (Task(source, plan.kinds[rank][source]),)

    plan.schedule = PlannedSchedule(plan.size, plan.size, tasks)
    return plan
