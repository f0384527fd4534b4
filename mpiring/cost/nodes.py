"""Who sends how many bytes to whom, and which of those cross between nodes. No MPI.

    python -m mpiring schedule -P 4 --causal      # the plan; ``traffic`` is its bytes by (sender, receiver)

``traffic(plan, ...)[r][d]`` is what rank r sends rank d in one call (its row
sums are ``heads.predicted_bytes``). With the node of every rank
(``node_of[r]``, e.g. from the hostnames), ``inter_node_bytes`` is what
crosses between nodes: on a cluster, what the slow links carry.
"""

from ..core.precision import compute_itemsize, row_bytes
from ..plans.heads import HEAD_MODES, HybridPlan, kv_heads, ulysses_pair_bytes
from .costmodel import predicted_backward_bytes, predicted_bytes_sent

__all__ = ["traffic", "predicted_bytes", "inter_node_bytes", "node_ids"]


def _add(matrix, r, d, nbytes):
    if d != r:
        matrix[r][d] += nbytes


def traffic(plan, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None, wire_dtype=None):
    """``matrix[r][d]``: bytes rank r sends rank d under ``plan``; None for the all-gather (MPI picks its pattern).

    Ring modes: K/V blocks to the next rank of each stream; backward also the
    dK/dV partial onward (steps 1 .. R-1) and home, R ranks back. Ulysses: each
    all-to-all's share for each other rank (``heads.ulysses_pair_bytes``).
    Double ring: what ``DoubleRingPlan.sends`` lists. K/V on the wire of
    ``wire_dtype`` (``precision.row_bytes``: the input dtype when None), the
    partials in ``grad_itemsize`` bytes (default: ``grad_wire_dtype``'s for ``itemsize``).
    """
    P = plan.size
    n = [len(s) for s in plan.kv_shards]  # K/V blocks (and their dK/dV partials) are the keys' tokens
    matrix = [[0] * P for _ in range(P)]
    grad_itemsize = compute_itemsize(itemsize) if grad_itemsize is None else grad_itemsize
    shape = dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize, backward=backward,
                 grad_itemsize=grad_itemsize, wire_dtype=wire_dtype)
    if isinstance(plan, HybridPlan):
        return _grid_traffic(plan, matrix, **shape)
    if plan.mode == "allgather":
        return None
    if plan.mode in HEAD_MODES:
        return [[ulysses_pair_bytes(plan, r, d, **shape) for d in range(P)] for r in range(P)]
    kv_token = batch * hk * (row_bytes(wire_dtype, dim, itemsize) + row_bytes(wire_dtype, dim_v, itemsize))
    grad_token = batch * hk * (dim + dim_v) * grad_itemsize
    if plan.mode == "double_ring":
        for r in range(P):
            for _, dest, source, what, _ in plan.sends(r, backward):
                _add(matrix, r, dest, n[source] * (kv_token if what == "K/V" else grad_token))
        return matrix
    for r in range(P):
        for stream, rounds in plan.rounds.items():
            ahead = (r + stream) % P
            for step in range(rounds):  # K/V onward
                _add(matrix, r, ahead, n[plan.held_source(r, stream, step)] * kv_token)
            if backward and rounds:
                for step in range(1, rounds):  # the partial onward, with its block
                    _add(matrix, r, ahead, n[plan.held_source(r, stream, step)] * grad_token)
                home = plan.held_source(r, stream, rounds)  # the last visitor sends it home
                _add(matrix, r, home, n[home] * grad_token)
    return matrix


def _group_pair(plan, r, d, *, batch, hq, hk, dim, dim_v, itemsize, backward, grad_itemsize, wire_dtype):
    """Bytes member r sends member d of its group in the grid's two all-to-alls.

    Out: d's Hq/u query heads of r's tokens (backward also dout, out and lse:
    the inner ring's backward takes out; these in the dtype tiles compute in)
    and d's K/V heads of r's keys on the K/V wire; back: r's heads of d's
    tokens (out in the input dtype, lse in the compute dtype, as every mode
    returns it; backward dq, and dK, dV of r's K/V heads of d's keys, in
    ``grad_itemsize`` bytes).
    """
    u = plan.ulysses_size
    hq_l, n_r, n_d = hq // u, len(plan.shards[r]), len(plan.shards[d])
    m_r, m_d = len(plan.kv_shards[r]), len(plan.kv_shards[d])
    kv_r, kv_d = (len(range(hk)[kv_heads(x % u, u, hk)]) for x in (r, d))
    kv_row = row_bytes(wire_dtype, dim, itemsize) + row_bytes(wire_dtype, dim_v, itemsize)
    compute = compute_itemsize(itemsize)
    if backward:
        out = n_r * hq_l * (dim + 2 * dim_v + 1) * compute + m_r * kv_d * kv_row
        back = (n_d * hq_l * dim + m_d * kv_r * (dim + dim_v)) * grad_itemsize
    else:
        out = n_r * hq_l * dim * itemsize + m_r * kv_d * kv_row
        back = n_d * hq_l * (dim_v * itemsize + compute)
    return batch * (out + back)


def _inner_shapes(plan, shape):
    """Per place j of a group: the shape its ring across the groups moves (Hq/u heads, its K/V heads); the
    backward's inputs in the dtype tiles compute in, as the all-to-all brought them."""
    u, hk = plan.ulysses_size, shape["hk"]
    itemsize = compute_itemsize(shape["itemsize"]) if shape["backward"] else shape["itemsize"]
    return [dict(shape, hq=shape["hq"] // u, hk=len(range(hk)[kv_heads(j, u, hk)]), itemsize=itemsize)
            for j in range(u)]


def _grid_traffic(plan, matrix, **shape):
    """The grid: the group all-to-alls, and each place's ring across the groups (None if that is an all-gather)."""
    u, P = plan.ulysses_size, plan.size
    for r in range(P):
        for d in range(P):
            if r // u == d // u and r != d:
                matrix[r][d] += _group_pair(plan, r, d, **shape)
    for j, inner in enumerate(_inner_shapes(plan, shape)):  # the ring of place j: the groups' tokens
        ring = traffic(plan.ring_plan, **inner)
        if ring is None:
            return None
        for g, row in enumerate(ring):
            for g2, nbytes in enumerate(row):
                matrix[g * u + j][g2 * u + j] += nbytes
    return matrix


def predicted_bytes(plan, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None,
                    wire_dtype=None):
    """Bytes each rank sends under any plan: the row sums of ``traffic`` (all-gather: as a ring all-gather)."""
    grad_itemsize = compute_itemsize(itemsize) if grad_itemsize is None else grad_itemsize
    shape = dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize, backward=backward,
                 grad_itemsize=grad_itemsize, wire_dtype=wire_dtype)
    matrix = traffic(plan, **shape)
    if matrix is not None:
        return [sum(row) for row in matrix]
    if isinstance(plan, HybridPlan):  # all-gather across the groups: its bytes, plus the group all-to-alls
        u = plan.ulysses_size
        across = [predicted_bytes(plan.ring_plan, **inner) for inner in _inner_shapes(plan, shape)]
        return [across[r % u][r // u] + sum(_group_pair(plan, r, d, **shape) for d in range(plan.size)
                                            if d // u == r // u and d != r) for r in range(plan.size)]
    kv_token = batch * hk * (row_bytes(wire_dtype, dim, itemsize) + row_bytes(wire_dtype, dim_v, itemsize))
    if not backward:  # widths in bytes, at 1 byte each
        return predicted_bytes_sent(plan, kv_token, 1)
    return predicted_backward_bytes(plan, kv_token, 1, grad_itemsize, batch * hk * (dim + dim_v))


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
