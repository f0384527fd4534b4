"""The one place in cost/ that tells the strategies apart: what each one sends, and how its time adds up. No MPI.

Every plan names its strategy (``plan.strategy``: "ring", "bidirectional",
"allgather", "ulysses", "double_ring", "sparse", or "grid" for ring x Ulysses).
``STRATEGIES[plan.strategy]`` holds that strategy's cost functions, and
``costmodel``, ``nodes`` and ``cluster_model`` call them without comparing
modes, plan classes or names themselves. A new strategy is one entry of
``STRATEGIES`` and its functions, here.

``shape``: the dict of ``batch, hq, hk, dim, dim_v, itemsize, backward,
grad_itemsize, wire_dtype`` that ``nodes.traffic`` takes (``full_shape``).
"""

from typing import Callable, NamedTuple

from ..core.precision import compute_itemsize, row_bytes
from ..plans.heads import deal_heads, ulysses_pair_bytes
from ..plans.make import make_plan

__all__ = ["Strategy", "Analytic", "STRATEGIES", "TIME_VARIANTS", "strategy_of", "analytic", "full_shape",
           "predicted_bytes_sent", "predicted_backward_bytes", "traffic_of", "bytes_of", "compared_plan",
           "TIME_NOTES", "kv_tokens_sent"]


class Analytic(NamedTuple):
    """A strategy in the analytic time model (``costmodel.time_model``), under the names of its ``variants``."""

    variants: tuple
    model: Callable  # (P, machine, first, later, full, blk_bytes, kv_bytes, b, n) -> (compute, transfer, hops, hide)
    up_front: bool = False  # every transfer at step 0: the steady row of the tables is step 0
    note: str = ""


class Strategy(NamedTuple):
    """One strategy's cost functions."""

    kv_transfers: Callable  # (plan, rank) -> [(step, [blocks])]: the K/V transfers of the byte model, one an item
    grad_blocks: Callable  # (plan, rank) -> blocks whose dK/dV partials rank sends (backward byte model)
    traffic: Callable  # (plan, shape) -> matrix[r][d] of bytes, or None (a collective: MPI picks its pattern)
    cluster_time: Callable  # (plan, cluster, link, shape) -> {"total", "compute", "exposed"}; link(sends) -> s
    gathered: Callable | None = None  # (plan, shape) -> bytes per rank where traffic is None
    sends: Callable | None = None  # (plan, rank, backward) -> [(step, dest, source, what)]: point-to-point sends
    label: str | None = None  # its name in cluster_model.compare_modes (None: the strategy's)
    head_split: Callable | None = None  # (cluster) -> ranks that share out the heads (None: heads stay whole)
    compared: Callable | None = None  # (seq_len, cluster, layout, causal) -> the plan compare_modes times
    analytic: Analytic | None = None
    kv_tokens: Callable | None = None  # (plan, rank) -> [(step, tokens)] when not whole blocks travel (None:
    grad_tokens: Callable | None = None  # kv_transfers' blocks); (plan, rank) -> tokens of each dK/dV partial


def strategy_of(plan):
    """The cost functions of ``plan``'s strategy."""
    try:
        return STRATEGIES[plan.strategy]
    except KeyError:
        raise ValueError(f"no cost model for strategy {plan.strategy!r}: add its entry to cost.by_strategy") from None


def full_shape(*, batch, hq, hk, dim, dim_v, itemsize, backward=False, grad_itemsize=None, wire_dtype=None):
    """The shape dict the traffic functions take, the gradient wire defaulted to the compute dtype."""
    grad_itemsize = compute_itemsize(itemsize) if grad_itemsize is None else grad_itemsize
    return dict(batch=batch, hq=hq, hk=hk, dim=dim, dim_v=dim_v, itemsize=itemsize, backward=backward,
                grad_itemsize=grad_itemsize, wire_dtype=wire_dtype)


# ---------------------------------------------------------------- the byte model of K/V and their dK/dV

def predicted_bytes_sent(plan, kv_width, itemsize):
    """Bytes each rank sends under ``plan``; ``kv_width`` = elements of K plus V per token.

    For an even split this is the cost report's total_comm_bytes (times batch) when
    every ring step is needed; windows and packed documents can stop the ring
    early, and the all-gather mode moves the same bytes in one collective.
    """
    return [sum(tokens for _, tokens in kv_tokens_sent(plan, rank)) * kv_width * itemsize for rank in range(plan.size)]


def kv_tokens_sent(plan, rank):
    """``[(step, tokens)]``: the K/V tokens of each transfer ``rank`` starts, by step (whole blocks unless the
    strategy says otherwise: ``Strategy.kv_tokens``)."""
    strategy = strategy_of(plan)
    if strategy.kv_tokens is not None:
        return strategy.kv_tokens(plan, rank)
    return [(step, sum(len(plan.kv_shards[b]) for b in blocks)) for step, blocks in strategy.kv_transfers(plan, rank)]


def predicted_backward_bytes(plan, kv_width, itemsize, grad_itemsize=None, grad_width=None):
    """Bytes each rank sends in the backward pass; ``kv_width`` = elements of K plus V per token.

    Ring modes: at steps 0 .. R-1 of a stream the rank sends the K/V block it
    holds, at steps 1 .. R the dK/dV partial of the block it holds (in
    ``grad_itemsize`` bytes per element: by default float32's 4, float64's 8
    when ``itemsize`` is 8, as ``grad_wire_dtype`` defaults). All-gather: K/V as the forward pass
    counts them, then every block but the rank's own once as dK/dV. ``grad_width``:
    elements of dK plus dV per token when K/V travel wider rows (an int8 wire's scales); default kv_width.
    """
    grad_itemsize = compute_itemsize(itemsize) if grad_itemsize is None else grad_itemsize
    grad_width = kv_width if grad_width is None else grad_width
    n, strategy = [len(s) for s in plan.kv_shards], strategy_of(plan)
    tokens = strategy.grad_tokens or (lambda plan, rank: [n[b] for b in strategy.grad_blocks(plan, rank)])
    return [kv_bytes + grad_width * sum(tokens(plan, rank)) * grad_itemsize
            for rank, kv_bytes in enumerate(predicted_bytes_sent(plan, kv_width, itemsize))]  # K/V: as forward


def _stream_transfers(plan, rank):
    """Ring streams: at each step one transfer of the blocks the rank holds on every stream still running."""
    last = max(plan.rounds.values(), default=0)
    return [(step, [plan.held_source(rank, d, step) for d, rounds in plan.rounds.items() if step < rounds])
            for step in range(last)]


def _stream_grads(plan, rank):
    return [plan.held_source(rank, d, s) for d, rounds in plan.rounds.items() for s in range(1, rounds + 1)]


def _gather_transfers(plan, rank):
    """The all-gather: the rank's block, P - 1 times, all at step 0 (a ring all-gather's transfers)."""
    return [(0, [rank])] * (plan.size - 1)


def _gather_grads(plan, rank):
    return [j for j in range(plan.size) if j != rank]


def _sparse_transfers(plan, rank):
    """The sparse movement: the rank's own block, once to each rank that needs it, all posted at step 0."""
    return [(0, [rank])] * len(plan.users[rank])


def _sparse_grads(plan, rank):
    """... and the dK/dV partial of each block it needed, straight home."""
    return plan.needs[rank]


def _sparse_tokens(plan, rank):
    """... each send carrying the keys of the block that its user's queries see (``SparsePlan.tokens``)."""
    return [(0, plan.tokens(user, rank)) for user in plan.users[rank]]


def _sparse_grad_tokens(plan, rank):
    return [plan.tokens(rank, source) for source in plan.needs[rank]]


def _sparse_traffic(plan, shape):
    """The sparse movement's sends (``SparsePlan.sends``), each of the tokens that travel to its user."""
    matrix = [[0] * plan.size for _ in range(plan.size)]
    kv_token, grad_token = _kv_token(shape), _grad_width(shape) * shape["grad_itemsize"]
    for r in range(plan.size):
        for _, dest, source, what in plan.sends(r, shape["backward"]):
            matrix[r][dest] += plan.tokens(dest, r) * kv_token if what == "K/V" else plan.tokens(r, source) * grad_token
    return matrix


def _nothing(plan, rank, backward=False):
    return []


def _as_groups_ring(role):
    """The grid's byte model: its ring's strategy's, over the grid's own ranks and streams."""
    return lambda plan, rank: getattr(strategy_of(plan.ring_plan), role)(plan, rank)


# ---------------------------------------------------------------- who sends how many bytes to whom

def traffic_of(plan, shape):
    """``matrix[r][d]``: bytes rank r sends rank d under ``plan`` (``nodes.traffic``); None for a collective."""
    return strategy_of(plan).traffic(plan, shape)


def bytes_of(plan, shape):
    """Bytes each rank sends under ``plan`` (``nodes.predicted_bytes``): the row sums of ``traffic_of``."""
    matrix = traffic_of(plan, shape)
    if matrix is not None:
        return [sum(row) for row in matrix]
    return strategy_of(plan).gathered(plan, shape)


def _stream_sends(plan, rank, backward=False):
    """Ring streams: K/V to the next rank of each stream; backward also the partial onward and, last, home."""
    out = []
    for stream, rounds in plan.rounds.items():
        ahead = (rank + stream) % plan.size
        out += [(step, ahead, plan.held_source(rank, stream, step), "K/V") for step in range(rounds)]
        if backward and rounds:
            out += [(step, ahead, plan.held_source(rank, stream, step), "dK/dV") for step in range(1, rounds)]
            home = plan.held_source(rank, stream, rounds)  # the last visitor sends it home
            out.append((rounds, home, home, "dK/dV home"))
    return out


def _double_ring_sends(plan, rank, backward=False):
    return [(step, dest, source, what) for step, dest, source, what, _ in plan.sends(rank, backward)]


def _plan_sends(plan, rank, backward=False):
    return plan.sends(rank, backward)


def _sends_traffic(plan, shape):
    """Point-to-point sends of K/V blocks (``Strategy.sends``), on the wire of ``wire_dtype``, and their partials."""
    P, n = plan.size, [len(s) for s in plan.kv_shards]
    kv_token, grad_token = _kv_token(shape), _grad_width(shape) * shape["grad_itemsize"]
    matrix = [[0] * P for _ in range(P)]
    sends = strategy_of(plan).sends
    for r in range(P):
        for _, dest, source, what in sends(plan, r, shape["backward"]):
            if dest != r:
                matrix[r][dest] += n[source] * (kv_token if what == "K/V" else grad_token)
    return matrix


def _collective(plan, shape):
    return None


def _gathered_kv(plan, shape):
    """The all-gather's bytes, as a ring all-gather (and backward a ring reduce-scatter) moves them."""
    if not shape["backward"]:  # widths in bytes, at 1 byte each
        return predicted_bytes_sent(plan, _kv_token(shape), 1)
    return predicted_backward_bytes(plan, _kv_token(shape), 1, shape["grad_itemsize"], _grad_width(shape))


def _kv_token(shape):
    """Bytes of one token's K and V, all batch rows and K/V heads, on the K/V wire."""
    wire, itemsize = shape["wire_dtype"], shape["itemsize"]
    return shape["batch"] * shape["hk"] * (row_bytes(wire, shape["dim"], itemsize)
                                           + row_bytes(wire, shape["dim_v"], itemsize))


def _grad_width(shape):
    """Elements of one token's dK and dV, all batch rows and K/V heads."""
    return shape["batch"] * shape["hk"] * (shape["dim"] + shape["dim_v"])


def _ulysses_traffic(plan, shape):
    P = plan.size
    return [[ulysses_pair_bytes(plan, r, d, **shape) for d in range(P)] for r in range(P)]


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
    deal = deal_heads(hq, hk, u)
    (q_r, q_d), (kv_r, kv_d) = ([c[x % u] for x in (r, d)] for c in (deal.counts(), deal.counts(kv=True)))
    n_r, n_d = len(plan.shards[r]), len(plan.shards[d])
    m_r, m_d = len(plan.kv_shards[r]), len(plan.kv_shards[d])
    kv_row = row_bytes(wire_dtype, dim, itemsize) + row_bytes(wire_dtype, dim_v, itemsize)
    compute = compute_itemsize(itemsize)
    if backward:
        out = n_r * q_d * (dim + 2 * dim_v + 1) * compute + m_r * kv_d * kv_row
        back = (n_d * q_r * dim + m_d * kv_r * (dim + dim_v)) * grad_itemsize
    else:
        out = n_r * q_d * dim * itemsize + m_r * kv_d * kv_row
        back = n_d * q_r * (dim_v * itemsize + compute)
    return batch * (out + back)


def _inner_shapes(plan, shape):
    """Per place j of a group: the shape its ring across the groups moves (its query heads, the K/V heads it
    computes with: ``HeadDeal.held_counts``); the backward's inputs in the dtype tiles compute in, as the
    all-to-all brought them."""
    deal = deal_heads(shape["hq"], shape["hk"], plan.ulysses_size)
    itemsize = compute_itemsize(shape["itemsize"]) if shape["backward"] else shape["itemsize"]
    return [dict(shape, hq=hq, hk=hk, itemsize=itemsize) for hq, hk in zip(deal.counts(), deal.held_counts())]


def _grid_traffic(plan, shape):
    """The grid: the group all-to-alls, and each place's ring across the groups (None if that is an all-gather)."""
    u, P = plan.ulysses_size, plan.size
    matrix = [[0] * P for _ in range(P)]
    for r in range(P):
        for d in range(P):
            if r // u == d // u and r != d:
                matrix[r][d] += _group_pair(plan, r, d, **shape)
    for j, inner in enumerate(_inner_shapes(plan, shape)):  # the ring of place j: the groups' tokens
        ring = traffic_of(plan.ring_plan, inner)
        if ring is None:
            return None
        for g, row in enumerate(ring):
            for g2, nbytes in enumerate(row):
                matrix[g * u + j][g2 * u + j] += nbytes
    return matrix


def _grid_gathered(plan, shape):
    """All-gather across the groups: its bytes, plus the group all-to-alls."""
    u = plan.ulysses_size
    across = [bytes_of(plan.ring_plan, inner) for inner in _inner_shapes(plan, shape)]
    return [across[r % u][r // u] + sum(_group_pair(plan, r, d, **shape) for d in range(plan.size)
                                        if d // u == r // u and d != r) for r in range(plan.size)]


# ---------------------------------------------------------------- time on a cluster of two link levels

def _step_sends(plan, per_token):
    """Per step: [(src, dst, bytes)] of the K/V sends started at that step (``Strategy.sends``, forward)."""
    n, sends = [len(s) for s in plan.shards], strategy_of(plan).sends
    out = [[] for _ in range(plan.n_steps)]
    for r in range(plan.size):
        for step, dest, source, _ in sends(plan, r):
            out[step].append((r, dest, n[source] * per_token))
    return out


def _steps(plan, cluster, link, shape):
    """Per step: (the busiest rank's compute, its transfers' time)."""
    pair = 4 * shape["batch"] * shape["hq"] * shape["dim"] / cluster.flops  # seconds per (query, key) pair
    per_token = shape["batch"] * shape["hk"] * (shape["dim"] + shape["dim_v"]) * shape["itemsize"]

    def compute(rank, step):
        return sum((p.q1 - p.q0) * (p.k1 - p.k0) for t in plan.tasks(step, rank)
                   for p in plan.pieces(rank, t.source)) * pair

    sends = _step_sends(plan, per_token)
    return [(max(compute(r, s) for r in range(plan.size)), link(sends[s])) for s in range(plan.n_steps)], sends


def _timed(total, work):
    return {"total": total, "compute": work, "exposed": max(0.0, total - work)}


def _ring_time(plan, cluster, link, shape):
    """A step takes max(compute, its transfers)."""
    steps, _ = _steps(plan, cluster, link, shape)
    return _timed(sum(max(c, t) for c, t in steps), sum(c for c, _ in steps))


def _double_ring_time(plan, cluster, link, shape):
    """The outer transfer, started at a round's first step, has the round to finish."""
    steps, sends = _steps(plan, cluster, link, shape)
    total, n = 0.0, plan.node_size
    for start in range(0, plan.n_steps, n):
        inner = [(c, link([x for x in sends[start + i] if x[0] // n == x[1] // n]))
                 for i, (c, _) in enumerate(steps[start:start + n])]
        outer = link([x for x in sends[start] if x[0] // n != x[1] // n])
        total += max(sum(max(c, t) for c, t in inner), outer)
    return _timed(total, sum(c for c, _ in steps))


def _ulysses_time(plan, cluster, link, shape):
    """All-to-all in, compute (every pair, the most query heads a rank gets: Hq/P when they split evenly),
    all-to-all back."""
    heads = max(deal_heads(shape["hq"], shape["hk"], plan.size).counts())
    pair = 4 * shape["batch"] * heads * shape["dim"] / cluster.flops
    matrix = traffic_of(plan, full_shape(**shape))
    sends = [(r, d, b) for r, row in enumerate(matrix) for d, b in enumerate(row) if b]
    work = max(plan.computed_pairs()) * pair
    comm = link(sends)  # both all-to-alls' bytes, as one exchange's worth of link time
    return {"total": work + comm, "compute": work, "exposed": comm}


def _grid_time(plan, cluster, link, shape):
    """Ring x Ulysses: the group all-to-alls, then the ring of the groups (each step: compute or transfer)."""
    u, ring = plan.ulysses_size, plan.ring_plan
    batch, hq, hk, dim, dim_v, itemsize = (shape[k] for k in ("batch", "hq", "hk", "dim", "dim_v", "itemsize"))
    matrix = traffic_of(plan, full_shape(**shape))
    a2a = link([(r, d, matrix[r][d]) for r in range(plan.size) for d in range(plan.size)
                if r // u == d // u and matrix[r][d]])
    deal = deal_heads(hq, hk, u)
    pair = 4 * batch * max(deal.counts()) * dim / cluster.flops  # the place with the most query heads
    places = [_step_sends(ring, batch * held * (dim + dim_v) * itemsize)
              for held in deal.held_counts()]  # place j of every group: its K/V heads of the group's tokens
    total = work = 0.0
    for step in range(ring.n_steps):
        compute = max(sum((p.q1 - p.q0) * (p.k1 - p.k0) for t in ring.tasks(step, g) for p in ring.pieces(g, t.source))
                      for g in range(ring.size)) * pair
        sends = [(g * u + j, d * u + j, b) for j in range(u) for g, d, b in places[j][step]]
        total += max(compute, link(sends))
        work += compute
    return _timed(total + a2a, work)


# ---------------------------------------------------------------- which plan compare_modes times

def _all_heads(cluster):
    return cluster.size


def _node_heads(cluster):
    return cluster.node_size


def _grid_compared(seq_len, cluster, layout, causal):
    return make_plan(seq_len, cluster.size, layout=layout, mode="ring", causal=causal, ulysses_size=cluster.node_size)


def compared_plan(name, seq_len, cluster, *, layout, causal, hq, hk):
    """The plan ``compare_modes`` times as ``name`` (a mode, or an entry's ``label``); None when the heads do
    not split over the ranks that share them out (fewer query heads than those ranks)."""
    entry = _LABELS.get(name)
    split = entry.head_split(cluster) if entry and entry.head_split else None
    if split and hq < split:
        return None
    if entry and entry.compared:
        return entry.compared(seq_len, cluster, layout, causal)
    return make_plan(seq_len, cluster.size, layout=layout, mode=name, causal=causal, node_size=cluster.node_size)


# ---------------------------------------------------------------- the analytic time model's steps

def _ring_model(P, m, first, later, full, blk_bytes, kv_bytes, b, n):
    """P steps, P-1 transfers; dK/dV go home in one hop."""
    compute = [first * full] + [later * full] * (P - 1)
    return compute, [m.transfer_time(blk_bytes)] * (P - 1) + [0.0], 1, (1, 1, later, b, 1)


def _bidirectional_model(P, m, first, later, full, blk_bytes, kv_bytes, b, n):
    """floor(P/2)+1 steps of two blocks; both sends share the device's bandwidth."""
    compute, transfer = [], []
    fwd, bwd = P // 2, (P - 1) // 2  # transfers along each stream
    for s in range(P // 2 + 1):
        blocks = 1 if s == 0 else 1 + (s <= bwd)
        compute.append((first if s == 0 else later) * full * blocks)
        sends = (s < fwd) + (s < bwd)
        transfer.append(m.transfer_time(sends * blk_bytes) if sends else 0.0)
    return compute, transfer, 1, (2, 2, later, b, 1)


def _allgather_model(P, m, first, later, full, blk_bytes, kv_bytes, b, n):
    """K/V gathered once behind the local block (a ring all-gather: P-1 transfers in a row); dK/dV home by a
    ring reduce-scatter, P-1 transfers."""
    compute = [first * full] + [later * full] * (P - 1)
    transfer = [(P - 1) * m.transfer_time(kv_bytes)] + [0.0] * (P - 1)
    return compute, transfer, P - 1, (1, P - 1, first, kv_bytes / n, P - 1)


# ---------------------------------------------------------------- the table

_RING = dict(kv_transfers=_stream_transfers, grad_blocks=_stream_grads, traffic=_sends_traffic,
             cluster_time=_ring_time, sends=_stream_sends)

STRATEGIES = {
    "ring": Strategy(**_RING, analytic=Analytic(("contiguous", "zigzag", "striped"), _ring_model)),
    "bidirectional": Strategy(**_RING, analytic=Analytic(("bidirectional",), _bidirectional_model)),
    "allgather": Strategy(_gather_transfers, _gather_grads, _collective, _ring_time, gathered=_gathered_kv,
                          sends=_nothing, analytic=Analytic(("allgather",), _allgather_model, up_front=True, note=(
                              "allgather: transfer/step is the whole all-gather, hidden only behind the local "
                              "block; it keeps all P K/V blocks in memory."))),
    "ulysses": Strategy(_nothing, _nothing, _ulysses_traffic, _ulysses_time, head_split=_all_heads),  # heads move
    # the byte model (predicted_bytes_sent, predict_plan) counts the double ring's K/V as the flat ring's streams
    "double_ring": Strategy(_stream_transfers, _stream_grads, _sends_traffic, _double_ring_time,
                            sends=_double_ring_sends),
    "grid": Strategy(_as_groups_ring("kv_transfers"), _as_groups_ring("grad_blocks"), _grid_traffic, _grid_time,
                     gathered=_grid_gathered, label="hybrid", head_split=_node_heads, compared=_grid_compared),
    # every transfer posted at step 0 (the time model's step 0 carries them all, as the all-gather's)
    "sparse": Strategy(_sparse_transfers, _sparse_grads, _sparse_traffic, _ring_time, sends=_plan_sends,
                       kv_tokens=_sparse_tokens, grad_tokens=_sparse_grad_tokens),
}

_LABELS = {entry.label or name: entry for name, entry in STRATEGIES.items()}
_ANALYTIC = {v: entry.analytic for entry in STRATEGIES.values() if entry.analytic for v in entry.analytic.variants}
TIME_VARIANTS = tuple(_ANALYTIC)
TIME_NOTES = [entry.analytic.note for entry in STRATEGIES.values() if entry.analytic and entry.analytic.note]


def analytic(variant):
    """The analytic model of time-model ``variant`` (one of ``TIME_VARIANTS``)."""
    if variant not in _ANALYTIC:
        raise ValueError(f"variant must be one of {', '.join(TIME_VARIANTS)}; got {variant!r}")
    return _ANALYTIC[variant]
