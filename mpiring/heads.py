"""Ulysses (DeepSpeed-Ulysses): heads move, not K/V blocks. The plan and its bytes; no MPI.

    python -m mpiring schedule -P 4 --mode ulysses --causal --layout zigzag

One all-to-all turns every rank's sequence shard of all heads into all tokens
of its share of the heads: rank d gets query heads ``d*Hq/P .. (d+1)*Hq/P``
of every rank's tokens. It attends them over the whole sequence with the same
block code as the ring (one key block per source rank, ``block.attend`` /
``block.grads_of``), and a second all-to-all returns each rank's tokens.

After the first all-to-all a rank holds the tokens in shard order (rank 0's
positions, then rank 1's, ...), so every layout works unchanged: query shard
i against key block j is the ring plan's ``pieces(i, j)``, moved to the rows
where shard i sits (``UlyssesPlan.block_pieces``).

K/V heads: with Hk divisible by P each rank gets Hk/P of them, the ones its
query heads use. With fewer K/V heads than ranks (P divisible by Hk), each
rank gets the one K/V head of its query heads: every K/V head is sent to P/Hk
ranks, so the K/V part of the all-to-all is P/Hk times what an even split of
heads would move (it equals ``1 x n x (D + Dv)`` per destination, the size of
one head, instead of ``Hk/P`` of one). In the backward pass the replicas' dK,
dV (each from a subset of the group's query heads) are summed at the owner.
"""

from dataclasses import dataclass

from .plan import Piece, Plan, Schedule, Task

__all__ = ["HEAD_MODES", "UlyssesPlan", "ulysses_plan", "heads_problem", "query_heads", "kv_heads",
           "ulysses_pair_bytes", "predicted_ulysses_bytes"]

HEAD_MODES = ("ulysses",)


def heads_problem(q, k, size, mode):
    """Why ``mode`` cannot split the heads of q, k over ``size`` ranks, or None (never raises).

    Called on each rank before the agreement; every rank has the same head
    counts (the agreement compares shapes), so every rank finds the same problem.
    """
    if mode not in HEAD_MODES:
        return None
    try:
        if q.ndim < 3:
            return None if size == 1 else (f"mode={mode!r} splits the heads axis over the ranks: q needs shape "
                                            f"(..., heads, seq, dim), got {q.shape}")
        hq, hk = q.shape[-3], k.shape[-3]
    except AttributeError:  # not arrays: local_problem reports it
        return None
    if hq % size:
        return f"mode={mode!r} needs the query heads ({hq}) divisible by the number of ranks ({size})"
    if hk % size and size % hk:
        return (f"mode={mode!r} needs the K/V heads ({hk}) to divide or be divisible by the number of ranks "
                f"({size})")
    return None


def query_heads(rank, size, hq):
    """The query heads rank ``rank`` attends, as a slice."""
    per = hq // size
    return slice(rank * per, (rank + 1) * per)


def kv_heads(rank, size, hk):
    """The K/V heads rank ``rank``'s query heads use, as a slice: Hk/P of them, or one when Hk < P."""
    if hk >= size:
        return slice(rank * hk // size, (rank + 1) * hk // size)
    first = rank * hk // size
    return slice(first, first + 1)


@dataclass
class UlyssesPlan(Plan):
    """A ring plan's shards, masks and pieces, followed in one step: every rank does every block, for its heads."""

    def block_pieces(self, source):
        """Every query shard against key block ``source``, rows moved to where the shard sits after the all-to-all."""
        starts = self.offsets()
        return [Piece(a + starts[i], b + starts[i], c, d, klo, khi)
                for i in range(self.size) for a, b, c, d, klo, khi in self.pieces(i, source)]

    def offsets(self):
        """Where each rank's tokens start in the gathered (shard-ordered) sequence."""
        starts, total = [], 0
        for s in self.shards:
            starts.append(total)
            total += len(s)
        return starts

    def visible_pairs(self):
        """Per rank: (query, key) pairs its kernel is given the mask of, for its heads: the whole sequence's."""
        return [int(sum(map(sum, self.pairs)))] * self.size

    def computed_pairs(self):
        total = sum((p.q1 - p.q0) * (p.k1 - p.k0) for j in range(self.size) for p in self.block_pieces(j))
        return [total] * self.size

    def messages_per_rank(self):
        """Two all-to-alls (heads out, results back), P - 1 messages each."""
        return 2 * (self.size - 1)

    def backward_messages_per_rank(self):
        return 2 * (self.size - 1)


def _column_kind(kinds, source):
    column = {row[source] for row in kinds}
    if column == {"skip"}:
        return "skip"
    return "full" if column == {"full"} else "masked"


def ulysses_plan(base):
    """The Ulysses plan over the shards and masks of ``base`` (a ring plan of the same options)."""
    fields = {name: getattr(base, name) for name in ("seq_len", "size", "layout", "causal", "window", "cu_seqlens",
                                                     "shards", "runs", "kinds", "pairs")}
    plan = UlyssesPlan(**fields, mode="ulysses", rounds={})
    tasks = tuple(Task(j, _column_kind(base.kinds, j), 0) for j in range(base.size))
    plan.schedule = Schedule([[tasks] * base.size])
    return plan


def ulysses_pair_bytes(plan, r, d, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=8):
    """Bytes rank r sends rank d under a Ulysses plan (0 to itself: that share never leaves it).

    Forward: d's query heads of r's tokens (``Hq/P x n_r x D``) and the K/V
    heads d uses (``kv_d x n_r x (D + Dv)``), then back d's tokens of r's
    heads, out and lse (``Hq/P x n_d x (Dv + 1)``), all in the input dtype.
    Backward: out goes as delta, so ``Hq/P x n_r x (D + Dv + 2)`` (q, dout,
    lse, delta) and the K/V heads; back dq and the dK, dV of r's K/V heads
    for d's tokens, in ``grad_itemsize`` bytes.
    """
    if r == d:
        return 0
    P = plan.size
    hq_l, n_r, n_d = hq // P, len(plan.shards[r]), len(plan.shards[d])
    kv_r, kv_d = (len(range(hk)[kv_heads(x, P, hk)]) for x in (r, d))  # K/V heads each rank gets
    if backward:
        return batch * (n_r * (hq_l * (dim + dim_v + 2) + kv_d * (dim + dim_v)) * itemsize
                        + n_d * (hq_l * dim + kv_r * (dim + dim_v)) * grad_itemsize)
    return batch * (n_r * (hq_l * dim + kv_d * (dim + dim_v)) + n_d * hq_l * (dim_v + 1)) * itemsize


def predicted_ulysses_bytes(plan, **shape):
    """Bytes each rank sends under a Ulysses plan: ``ulysses_pair_bytes`` to every other rank."""
    return [sum(ulysses_pair_bytes(plan, r, d, **shape) for d in range(plan.size)) for r in range(plan.size)]
