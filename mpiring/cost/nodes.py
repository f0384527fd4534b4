"""Who sends how many bytes to whom, and which of those cross between nodes. No MPI.

    python -m mpiring schedule -P 4 --causal      # the plan; ``traffic`` is its bytes by (sender, receiver)

``traffic(plan, ...)[r][d]`` is what rank r sends rank d in one call (its row
sums are ``heads.predicted_bytes``). With the node of every rank
(``node_of[r]``, e.g. from the hostnames), ``inter_node_bytes`` is what
crosses between nodes: on a cluster, what the slow links carry.
"""

from .by_strategy import bytes_of, full_shape, traffic_of

__all__ = ["traffic", "predicted_bytes", "inter_node_bytes", "node_ids"]


def traffic(plan, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None, wire_dtype=None):
    """``matrix[r][d]``: bytes rank r sends rank d under ``plan``; None for the all-gather (MPI picks its pattern).

    Ring modes: K/V blocks to the next rank of each stream; backward also the
    dK/dV partial onward (steps 1 .. R-1) and home, R ranks back. Ulysses: each
    all-to-all's share for each other rank (``heads.ulysses_pair_bytes``).
    Double ring: what ``DoubleRingPlan.sends`` lists. Ring x Ulysses: the group
    all-to-alls and the ring across the groups. K/V on the wire of
    ``wire_dtype`` (``precision.row_bytes``: the input dtype when None), the
    partials in ``grad_itemsize`` bytes (default: ``grad_wire_dtype``'s for ``itemsize``).
    Each strategy's rule is its entry of ``strategies.STRATEGIES``.
    """
    return traffic_of(plan, full_shape(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize,
                                       backward=backward, grad_itemsize=grad_itemsize, wire_dtype=wire_dtype))


def predicted_bytes(plan, *, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None,
                    wire_dtype=None):
    """Bytes each rank sends under any plan: the row sums of ``traffic`` (all-gather: as a ring all-gather)."""
    return bytes_of(plan, full_shape(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize,
                                     backward=backward, grad_itemsize=grad_itemsize, wire_dtype=wire_dtype))


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
