"""Who sends how many bytes to whom, and which of those cross between nodes. No MPI.

    python -m mpiring schedule -P 4 --causal      # the plan; ``traffic`` is its bytes by (sender, receiver)

``traffic(plan, ...)[r][d]`` is what rank r sends rank d in one call (its row
sums are ``heads.predicted_bytes``). With the node of every rank
(``node_of[r]``, e.g. from the hostnames), ``inter_node_bytes`` is what
crosses between nodes: on a cluster, what the slow links carry.
"""

from .costmodel import predicted_backward_bytes, predicted_bytes_sent
from .heads import HEAD_MODES, HybridPlan, compute_itemsize, kv_heads, ulysses_pair_bytes

__all__ = ["traffic", "predicted_bytes", "inter_node_bytes", "node_ids"]


def _add(matrix, r, d, nbytes):
    if d != r:
        matrix[r][d] += nbytes


def traffic(plan, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None):
    """``matrix[r][d]``: bytes rank r sends rank d under ``plan``; None for the all-gather (MPI picks its pattern).

    Ring modes: K/V blocks to the next rank of each stream; backward also the
    dK/dV partial onward (steps 1 .. R-1) and home, R ranks back. Ulysses: each
    all-to-all's share for each other rank (``heads.ulysses_pair_bytes``).
    Double ring: what ``DoubleRingPlan.sends`` lists. ``grad_itemsize``: bytes
    per element of the gradients that travel; by default what each strategy
    sends: Ulysses and the double ring float64, the ring modes their
    ``grad_wire_dtype`` default (float64 for 8-byte inputs, else float32).
    """
    P = plan.size
    n = [len(s) for s in plan.kv_shards]  # K/V blocks (and their dK/dV partials) are the keys' tokens
    matrix = [[0] * P for _ in range(P)]
    if isinstance(plan, HybridPlan):
        return _grid_traffic(plan, matrix, batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize,
                             backward=backward, grad_itemsize=grad_itemsize)
    if plan.mode == "allgather":
        return None
    if grad_itemsize is None:
        grad_itemsize = 8 if plan.mode in HEAD_MODES + ("double_ring",) or itemsize == 8 else 4
    if plan.mode in HEAD_MODES:
        shape = dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize, backward=backward,
                     grad_itemsize=grad_itemsize)
        return [[ulysses_pair_bytes(plan, r, d, **shape) for d in range(P)] for r in range(P)]
    per_token = batch * hk * (dim + dim_v)
    if plan.mode == "double_ring":  # K/V in the input dtype, partials in float64
        for r in range(P):
            for _, dest, source, what, _ in plan.sends(r, backward):
                _add(matrix, r, dest, n[source] * per_token * (itemsize if what == "K/V" else grad_itemsize))
        return matrix
    for r in range(P):
        for stream, rounds in plan.rounds.items():
            ahead = (r + stream) % P
            for step in range(rounds):  # K/V onward
                _add(matrix, r, ahead, n[plan.held_source(r, stream, step)] * per_token * itemsize)
            if backward and rounds:
                for step in range(1, rounds):  # the partial onward, with its block
                    _add(matrix, r, ahead, n[plan.held_source(r, stream, step)] * per_token * grad_itemsize)
                home = plan.held_source(r, stream, rounds)  # the last visitor sends it home
                _add(matrix, r, home, n[home] * per_token * grad_itemsize)
    return matrix


def _group_pair(plan, r, d, *, batch, hq, hk, dim, dim_v, itemsize, backward, **_):
    """Bytes member r sends member d of its group in the grid's two all-to-alls.

    Out: d's Hq/u query heads of r's tokens (backward also dout, out and lse:
    the inner ring's backward takes out) and d's K/V heads of r's keys; back:
    r's heads of d's tokens (out, lse; backward dq, and dK, dV of r's K/V heads
    of d's keys). Forward in the input dtype but lse (the compute dtype, as
    every mode returns it); backward all in the compute dtype (float32 for half).
    """
    u = plan.ulysses_size
    hq_l, n_r, n_d = hq // u, len(plan.shards[r]), len(plan.shards[d])
    m_r, m_d = len(plan.kv_shards[r]), len(plan.kv_shards[d])
    kv_r, kv_d = (len(range(hk)[kv_heads(x % u, u, hk)]) for x in (r, d))
    compute = compute_itemsize(itemsize)
    if backward:
        out = n_r * hq_l * (dim + 2 * dim_v + 1) + m_r * kv_d * (dim + dim_v)
        back = n_d * hq_l * dim + m_d * kv_r * (dim + dim_v)
        return batch * (out + back) * compute
    out = n_r * hq_l * dim + m_r * kv_d * (dim + dim_v)
    return batch * ((out + n_d * hq_l * dim_v) * itemsize + n_d * hq_l * compute)


def _grid_traffic(plan, matrix, *, backward, **shape):
    """The grid: the group all-to-alls, and each place's ring across the groups (None if that is an all-gather).

    The ring across groups gets its inputs in the dtype the all-to-all carried
    (the input dtype; the compute dtype in the backward), so its dK/dV partials
    travel as its default grad wire for that dtype: float64 for 8-byte inputs, else float32.
    """
    u, P = plan.ulysses_size, plan.size
    for r in range(P):
        for d in range(P):
            if r // u == d // u and r != d:
                matrix[r][d] += _group_pair(plan, r, d, backward=backward, **shape)
    itemsize = compute_itemsize(shape["itemsize"]) if backward else shape["itemsize"]
    for j in range(u):  # the ring of place j: Hq/u heads, its K/V heads, the groups' tokens
        inner = dict(shape, hq=shape["hq"] // u, hk=len(range(shape["hk"])[kv_heads(j, u, shape["hk"])]),
                     itemsize=itemsize, grad_itemsize=compute_itemsize(itemsize))
        ring = traffic(plan.ring_plan, **inner, backward=backward)
        if ring is None:
            return None
        for g, row in enumerate(ring):
            for g2, nbytes in enumerate(row):
                matrix[g * u + j][g2 * u + j] += nbytes
    return matrix


def predicted_bytes(plan, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None):
    """Bytes each rank sends under any plan: the row sums of ``traffic`` (all-gather: as a ring all-gather)."""
    shape = dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize, backward=backward)
    matrix = traffic(plan, **shape, grad_itemsize=grad_itemsize)
    if matrix is not None:
        return [sum(row) for row in matrix]
    if isinstance(plan, HybridPlan):  # all-gather across the groups: its bytes, plus the group all-to-alls
        u = plan.ulysses_size
        inner = compute_itemsize(itemsize) if backward else itemsize  # what the group all-to-all carried
        across = [predicted_bytes(plan.ring_plan, **dict(shape, hq=hq // u, hk=len(range(hk)[kv_heads(j, u, hk)]),
                                                         itemsize=inner))
                  for j in range(u)]
        return [across[r % u][r // u] + sum(_group_pair(plan, r, d, **shape) for d in range(plan.size)
                                            if d // u == r // u and d != r) for r in range(plan.size)]
    kv_width = batch * hk * (dim + dim_v)
    if backward:
        return predicted_backward_bytes(plan, kv_width, itemsize, grad_itemsize)
    return predicted_bytes_sent(plan, kv_width, itemsize)


def inter_node_bytes(matrix, node_of):
    """Per node: bytes its ranks send to ranks on other nodes."""
    sent = [0] * (max(node_of) + 1)
    for r, row in enumerate(matrix):
        for d, nbytes in enumerate(row):
            if node_of[r] != node_of[d]:
                sent[node_of[r]] += nbytes
    return sent


def node_ids(names):
    """Node index of every rank from its host name (``MPI.Get_processor_name()``): in order of first appearance."""
    first = {}
    return [first.setdefault(name, len(first)) for name in names]
