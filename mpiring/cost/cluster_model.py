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

from ..plans.heads import HEAD_MODES, HybridPlan, kv_heads
from ..plans.make import make_plan
from .nodes import traffic

__all__ = ["Cluster", "CLUSTERS", "emulated", "cluster_time", "compare_modes", "format_comparison", "COMPARED"]

COMPARED = ("ring", "double_ring", "ulysses", "hybrid")  # hybrid: ring x Ulysses, Ulysses inside each node
WIRE = 0.95  # of a tbf-shaped TCP link's rate that carries payload (measured 16.78 MB as 17.66 MB on the veth)


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


def _step_sends(plan, step, per_token):
    """[(src, dst, bytes)] started at ``step`` under a ring or double-ring plan."""
    n = [len(s) for s in plan.shards]
    if plan.mode == "double_ring":
        return [(r, dest, n[source] * per_token) for r in range(plan.size)
                for s, dest, source, _, _ in plan.sends(r) if s == step]
    return [(r, (r + d) % plan.size, n[plan.held_source(r, d, step)] * per_token)
            for r in range(plan.size) for d, rounds in plan.rounds.items() if step < rounds]


def cluster_time(plan, cluster, *, batch, hq, hk, dim, dim_v, itemsize):
    """Predicted forward time under ``plan`` on ``cluster``: dict of total, compute, exposed communication (s)."""
    if plan.size != cluster.size:
        raise ValueError(f"the plan is for {plan.size} ranks, the cluster has {cluster.size}")
    pair = 4 * batch * hq * dim / cluster.flops  # seconds per (query, key) pair, all heads

    def compute(rank, step):
        return sum((p.q1 - p.q0) * (p.k1 - p.k0) for t in plan.tasks(step, rank)
                   for p in plan.pieces(rank, t.source)) * pair

    if isinstance(plan, HybridPlan):
        return _grid_time(plan, cluster, traffic, batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v,
                          itemsize=itemsize)
    if plan.mode in HEAD_MODES:  # all-to-all in, compute (every pair, Hq/P heads), all-to-all back
        half = dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize)
        matrix = traffic(plan, **half)
        sends = [(r, d, b) for r, row in enumerate(matrix) for d, b in enumerate(row) if b]
        work = max(plan.computed_pairs()) * pair / plan.size
        comm = _transfer(cluster, sends)  # both all-to-alls' bytes, as one exchange's worth of link time
        return {"total": work + comm, "compute": work, "exposed": comm}
    per_token = batch * hk * (dim + dim_v) * itemsize
    steps = [(max(compute(r, s) for r in range(plan.size)), _transfer(cluster, _step_sends(plan, s, per_token)))
             for s in range(plan.n_steps)]
    if plan.mode == "double_ring":  # the outer transfer, started at a round's first step, has the round to finish
        total, n = 0.0, plan.node_size
        for start in range(0, plan.n_steps, n):
            inner = [(c, _transfer(cluster, [x for x in _step_sends(plan, start + i, per_token)
                                             if x[0] // n == x[1] // n])) for i, (c, _) in
                     enumerate(steps[start:start + n])]
            outer = _transfer(cluster, [x for x in _step_sends(plan, start, per_token) if x[0] // n != x[1] // n])
            total += max(sum(max(c, t) for c, t in inner), outer)
    else:
        total = sum(max(c, t) for c, t in steps)
    work = sum(c for c, _ in steps)
    return {"total": total, "compute": work, "exposed": max(0.0, total - work)}


def _grid_time(plan, cluster, traffic, *, batch, hq, hk, dim, dim_v, itemsize):
    """Ring x Ulysses: the group all-to-alls, then the ring of the groups (each step: compute or transfer)."""
    u, ring = plan.ulysses_size, plan.ring_plan
    matrix = traffic(plan, batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize)
    a2a = _transfer(cluster, [(r, d, matrix[r][d]) for r in range(plan.size) for d in range(plan.size)
                              if r // u == d // u and matrix[r][d]])
    pair = 4 * batch * (hq // u) * dim / cluster.flops
    total = work = 0.0
    for step in range(ring.n_steps):
        compute = max(sum((p.q1 - p.q0) * (p.k1 - p.k0) for t in ring.tasks(step, g) for p in ring.pieces(g, t.source))
                      for g in range(ring.size)) * pair
        sends = []
        for j in range(u):  # place j of every group: its K/V heads of the group's tokens
            per_token = batch * len(range(hk)[kv_heads(j, u, hk)]) * (dim + dim_v) * itemsize
            sends += [(g * u + j, d * u + j, b) for g, d, b in _step_sends(ring, step, per_token)]
        total += max(compute, _transfer(cluster, sends))
        work += compute
    return {"total": total + a2a, "compute": work, "exposed": max(0.0, total + a2a - work)}


def compare_modes(seq_len, cluster, *, causal, batch, hq, hk, dim, dim_v, itemsize, modes=COMPARED):
    """``{mode: cluster_time(...)}`` for each mode that fits (Ulysses needs heads divisible by the ranks)."""
    out = {}
    layout = "zigzag" if causal else "contiguous"
    for mode in modes:
        split = cluster.node_size if mode == "hybrid" else cluster.size  # the ranks that share out the heads
        if mode in HEAD_MODES + ("hybrid",) and (hq % split or (hk % split and split % hk)):
            continue
        if mode == "hybrid":
            plan = make_plan(seq_len, cluster.size, layout=layout, mode="ring", causal=causal,
                             ulysses_size=cluster.node_size)
        else:
            plan = make_plan(seq_len, cluster.size, layout=layout, mode=mode, causal=causal,
                             node_size=cluster.node_size)
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
        lines.append(f"not compared: {', '.join(skipped)} (heads not divisible by the ranks)")
    return "\n".join(lines)
