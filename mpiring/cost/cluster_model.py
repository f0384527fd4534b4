"""A time model with two link levels: inside a node and between nodes. No MPI.

    python -m mpiring cost --seq-len 131072 -P 16 --hidden 1024 --heads 8 --causal --cluster h100 --node-size 8

A ``Cluster`` is m nodes of n ranks: a FLOP rate per rank, a link per rank
inside a node (alpha, beta) and one link per node to the others (its
bandwidth shared by every rank of the node that sends across at once). The
model follows a concrete plan, step by step: each rank's compute from the
plan's pieces, each step's transfers from ``nodes.traffic``'s pattern, and

- ring, bidirectional: a step takes max(compute, its transfers), the slowest
  link deciding (a flat ring's node-boundary ranks cross every step);
- double ring: a round of n steps takes max(the inner steps, each
  max(compute, intra-node transfer), the outer transfer of all n ranks of a
  node over the node's link), since the outer transfer hides behind the round;
- Ulysses: the all-to-all in, the compute, the all-to-all back, one after
  the other (nothing to overlap);
- ring x Ulysses (``ulysses_size`` = the node size): the all-to-alls inside
  each node, then a ring across the nodes, where all n ranks of a node send
  at once over the node's link.

Forward pass only. ``emulated`` builds the cluster of ``run/cluster`` (tc
tbf links) with this machine's measured FLOP rate.
"""

from dataclasses import dataclass

from .by_strategy import compared_plan, strategy_of

__all__ = ["Cluster", "CLUSTERS", "emulated", "cluster_time", "compare_modes", "format_comparison", "COMPARED"]

COMPARED = ("ring", "double_ring", "ulysses", "hybrid")  # hybrid: ring x Ulysses, Ulysses inside each node
WIRE = 0.95  # of a tbf-shaped TCP link's rate that carries payload (measured: docs/cluster.md)


@dataclass(frozen=True)
class Cluster:
    """m nodes of n ranks: FLOP/s per rank, a link per rank in a node, one link per node to the others."""

    name: str
    nodes: int
    node_size: int
    flops: float
    intra_alpha: float
    intra_beta: float  # bytes/s per rank and direction inside a node
    inter_alpha: float
    inter_beta: float  # bytes/s per node and direction to other nodes (shared by the node's ranks)
    note: str = ""

    @property
    def size(self):
        return self.nodes * self.node_size


def _h100(nodes, node_size):
    # NVLink 4: 450 GB/s per GPU and direction, ~5 us; 8 NDR InfiniBand NICs per node, 50 GB/s each, ~10 us
    return Cluster("h100", nodes, node_size, 400e12, 5e-6, 450e9, 10e-6, 50e9 * node_size,
                   "H100 nodes: 400 TFLOP/s bf16 effective per GPU, NVLink 450 GB/s, one 400 Gb/s NIC per GPU")


def _ethernet(nodes, node_size):
    # the same GPUs with one 100 Gb/s Ethernet NIC per node (12.5 GB/s, ~20 us): a commodity cluster
    return Cluster("ethernet", nodes, node_size, 400e12, 5e-6, 450e9, 20e-6, 12.5e9,
                   "H100-class GPUs, NVLink inside a node, one 100 Gb/s Ethernet NIC per node")


CLUSTERS = {"h100": _h100, "ethernet": _ethernet}


def emulated(nodes, node_size, link_bits, flops, intra_beta, intra_alpha=1e-4):
    """``run/cluster up nodes --link RATE``: tbf links of ``link_bits`` bit/s (the payload gets WIRE of it)."""
    return Cluster("emulated", nodes, node_size, flops, intra_alpha, intra_beta, 1e-3, link_bits / 8 * WIRE,
                   f"run/cluster: {link_bits / 1e6:g} Mbit/s tbf links, {flops / 1e9:.3g} GFLOP/s per rank, "
                   f"{intra_beta / 1e9:.3g} GB/s inside a node")


def _transfer(cluster, sends):
    """Seconds for ``sends`` [(src, dst, bytes)] started together: the slowest link (a node's link is shared)."""
    node = [0.0] * cluster.nodes
    rank = {}
    for src, dst, nbytes in sends:
        if src // cluster.node_size != dst // cluster.node_size:
            node[src // cluster.node_size] += nbytes
        else:
            rank[src] = rank.get(src, 0) + nbytes
    t = [cluster.inter_alpha + b / cluster.inter_beta for b in node if b]
    t += [cluster.intra_alpha + b / cluster.intra_beta for b in rank.values()]
    return max(t, default=0.0)


def cluster_time(plan, cluster, *, batch, hq, hk, dim, dim_v, itemsize):
    """Predicted forward time under ``plan`` on ``cluster``: dict of total, compute, exposed communication (s).

    How a strategy's steps add up is its entry of ``strategies.STRATEGIES``; every transfer takes what ``_transfer``
    says of the links."""
    if plan.size != cluster.size:
        raise ValueError(f"the plan is for {plan.size} ranks, the cluster has {cluster.size}")
    shape = dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize)
    return strategy_of(plan).cluster_time(plan, cluster, lambda sends: _transfer(cluster, sends), shape)


def compare_modes(seq_len, cluster, *, causal, batch, hq, hk, dim, dim_v, itemsize, modes=COMPARED):
    """``{mode: cluster_time(...)}`` for each mode that fits (Ulysses needs a query head per rank)."""
    out = {}
    layout = "zigzag" if causal else "contiguous"
    for mode in modes:
        plan = compared_plan(mode, seq_len, cluster, layout=layout, causal=causal, hq=hq, hk=hk)
        if plan is None:  # its heads do not split over the ranks that share them out
            continue
        out[mode] = cluster_time(plan, cluster, batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize)
    return out


def format_comparison(seq_len, cluster, **shape):
    """``compare_modes`` as text, with the winner."""
    results = compare_modes(seq_len, cluster, **shape)
    lines = [f"cluster {cluster.name}: {cluster.nodes} nodes x {cluster.node_size} ranks; {cluster.note}",
             f"{'mode':<12}{'total':>12}{'compute':>12}{'exposed comm':>14}"]
    for mode, r in results.items():
        lines.append(f"{mode:<12}{r['total']:>12.4g}{r['compute']:>12.4g}{r['exposed']:>14.4g}")
    if results:
        best = min(float(f"{r['total']:.4g}") for r in results.values())  # equal to 4 digits: a tie
        fastest = [m for m, r in results.items() if float(f"{r['total']:.4g}") == best]
        lines.append(f"fastest: {' = '.join(fastest)} (seconds, forward pass; "
                     f"layout {'zigzag' if shape['causal'] else 'contiguous'})")
    skipped = [m for m in COMPARED if m not in results]
    if skipped:
        lines.append(f"not compared: {', '.join(skipped)} (fewer query heads than the ranks that share them)")
    return "\n".join(lines)
