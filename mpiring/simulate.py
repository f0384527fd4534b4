"""Ring attention simulated in one process: the same plan, kernels and merge, no MPI."""

import numpy as np

from .core.block import DELTA_DTYPE, Visit, accumulators, add_grads, attend, grads_of
from .core.kernels import default_scale
from .core.precision import INPUT_DTYPES, Precision
from .core.record import Record
from .core.scores import Score, with_sinks
from .plans.spec import spec_problem

__all__ = ["ring_attention_simulate", "simulate", "simulate_backward"]


def _as_float(name, a):
    a = np.asarray(a)
    if a.dtype.name not in INPUT_DTYPES:
        if not (np.issubdtype(a.dtype, np.number) and not np.issubdtype(a.dtype, np.complexfloating)):
            raise ValueError(f"{name} must hold real numbers, got dtype {a.dtype}")
        a = a.astype(np.float64)
    return a


def _prepared(Q, K, V, num_devices, options, spec, positions, backward=False):
    """The checked problem of ``simulate`` (and its backward): ``(spec, pr, plan, score, Q, K, V)``."""
    spec, problem = spec_problem(options, spec)
    if problem:
        raise ValueError(problem)
    if positions is not None:  # one array per device: the agreed form of the spec's positions
        spec = spec.replace(positions=positions)
    Q, K, V = (_as_float(n, a) for n, a in (("Q", Q), ("K", K), ("V", V)))
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if Q.ndim < 2 or Q.ndim != K.ndim or K.ndim != V.ndim:
        raise ValueError(f"Q, K, V must have shape (..., seq_len, d) with equal ranks, "
                         f"got {Q.shape}, {K.shape}, {V.shape}")
    keys = Q.shape[-2] if spec.kv_seq_len is None else spec.kv_seq_len  # cross-attention: keys of their own
    if K.shape[-2] != keys or K.shape[:-1] != V.shape[:-1] or Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"mismatched shapes: Q {Q.shape}, K {K.shape}, V {V.shape}"
                         + (f" (kv_seq_len={keys})" if spec.kv_seq_len is not None else ""))
    if Q.ndim >= 3 and (Q.shape[:-3] != K.shape[:-3] or Q.shape[-3] % K.shape[-3]):
        raise ValueError(f"Q heads must be a multiple of K/V heads: Q {Q.shape}, K {K.shape}")
    if Q.shape[-1] < 1 or Q.shape[-2] < 1:
        raise ValueError(f"sequence length and head dim must be positive, got {Q.shape}")
    dtype = Q.dtype if Q.dtype == K.dtype == V.dtype else np.result_type(Q, K, V)
    Q, K, V = (a.astype(dtype, copy=False) for a in (Q, K, V))
    pr = Precision.of(dtype, spec.precision)
    plan = spec.plan(int(num_devices), Q.shape[-2])
    scale = default_scale(Q.shape[-1]) if spec.scale is None else spec.scale
    problem = spec.scores_problem(Q) or (backward and spec.backward_problem())
    if problem:
        raise ValueError(problem)
    return spec, pr, plan, Score.of(spec, scale, backward=backward), Q, K, V


def _blocks(plan, pr, K, V):
    """Per device: its own K/V block as the kernel takes it (exact), and as the others get it (coded by the
    owner, decoded on arrival)."""
    own = [tuple(pr.widen(np.take(X, plan.kv_shards[j], axis=-2)) for X in (K, V)) for j in range(plan.size)]
    sent = [tuple(pr.wire.decode(pr.wire.encode(np.take(X, plan.kv_shards[j], axis=-2))) for X in (K, V))
            for j in range(plan.size)]
    return own, sent


def simulate(Q, K, V, num_devices, *, spec=None, causal=False, layout="contiguous", positions=None, **options):
    """Run every device's part of the ring in turn; return ``(out, lse, schedule)``.

    ``schedule`` is the plan's Schedule: ``schedule.table[step][device]``
    holds the Tasks (source block, full/masked/skip) of that step.
    ``options``: the fields of ``Spec`` as ``ring_attention`` takes them (``mode``: "ring" unless given; the
    same kernels: the same dropped entries); every block a device gets from another is coded and decoded as
    ``wire_dtype`` says.
    ``positions``: one array per device, the tokens it holds (instead of ``layout``).
    ``spec``: a ``Spec`` holding the options instead (its ``positions``, if any: every device's, as agreed).
    """
    spec, pr, plan, score, Q, K, V = _prepared(Q, K, V, num_devices, dict(options, causal=causal, layout=layout),
                                               spec, positions)
    P = plan.size
    kv, sent = _blocks(plan, pr, K, V)  # the others get a block coded by its owner, decoded on arrival
    outs, lses = [], []
    for device in range(P):
        q = pr.widen(np.ascontiguousarray(np.take(Q, plan.shards[device], axis=-2)))
        acc = accumulators(q, V, pr.out, pr.lse)  # float64 by default, as in the MPI ring
        rec = Record(device)
        for step in range(plan.n_steps):
            for task in plan.tasks(step, device):
                block = kv[device] if task.source == device else sent[task.source]
                rows = plan.kept(device, task.source)  # the sparse movement's chosen keys: those pieces index
                block = block if rows is None else tuple(np.take(x, rows, axis=-2) for x in block)
                attend(q, block, Visit(step, task, plan.pieces(device, task.source)), score, acc, rec, None)
        if spec.sinks is not None:
            acc = with_sinks(*acc, spec.sinks)
        outs.append(acc[0].astype(pr.input, copy=False))
        lses.append(acc[1].astype(pr.compute, copy=False))
    out = np.empty(Q.shape[:-1] + V.shape[-1:], pr.input)
    lse = np.empty(Q.shape[:-1], pr.compute)
    for device in range(P):
        out[..., plan.shards[device], :], lse[..., plan.shards[device]] = outs[device], lses[device]
    return out, lse, plan.schedule


def simulate_backward(dO, Q, K, V, out, lse, num_devices, *, positions=None, spec=None, **options):
    """The ring's backward pass simulated in one process: ``(dq, dk, dv)`` for ``simulate``'s ``(out, lse)``
    (with a ``TableBias`` bias, d table follows: ``(dq, dk, dv, dtable)``).

    Options as ``simulate`` takes them (the ring modes), and ``grad_wire_dtype``. Every device recomputes
    its rows against each block it visits, a block from another device coded and decoded as the wire
    would; a block's dK/dV partial is summed in ``grad_wire_dtype`` (default float32, float64 for float64
    inputs) by its visitors in the order they see it, as it travels, and added to its owner's own share in
    float64 at home.
    """
    spec, pr, plan, score, Q, K, V = _prepared(Q, K, V, num_devices, options, spec, positions, backward=True)
    dO, out, lse = (np.asarray(a) for a in (dO, out, lse))
    if dO.shape != out.shape or out.shape != Q.shape[:-1] + V.shape[-1:] or lse.shape != Q.shape[:-1]:
        raise ValueError(f"dO and out must have shape {Q.shape[:-1] + V.shape[-1:]} and lse {Q.shape[:-1]}; got "
                         f"{dO.shape}, {out.shape}, {lse.shape}")
    kv, sent = _blocks(plan, pr, K, V)
    rows = [[np.ascontiguousarray(np.take(X, plan.shards[d], axis=-2)) for X in (dO, Q, out)] for d in range(plan.size)]
    queries = [(do, q, o, np.take(lse, plan.shards[d], axis=-1),
                np.einsum("...d,...d->...", do, o, dtype=DELTA_DTYPE).astype(q.dtype))
               for d, (do, q, o) in enumerate(rows)]
    dq = [np.zeros(q.shape, pr.sums) for _, q, _ in rows]
    home = [[np.zeros(X.shape[:-2] + (len(s), X.shape[-1]), pr.sums) for X in (K, V)] for s in plan.kv_shards]
    partials, rec = {}, Record()
    for step in range(plan.n_steps):  # a block's visitors in the order it meets them
        for device in range(plan.size):
            for task in plan.tasks(step, device):
                mine = task.source == device
                block = kv[device] if mine else sent[task.source]
                visit = Visit(step, task, plan.pieces(device, task.source))
                grads = grads_of(queries[device], block, visit, score, dq[device], rec, lambda: None)
                total = home[task.source] if mine else partials.setdefault(
                    (task.source, task.stream), [np.zeros(h.shape, pr.grad) for h in home[task.source]])
                add_grads(total, grads)
    for (source, _), partial in partials.items():
        add_grads(home[source], [(0, partial[0].shape[-2], *partial)])
    grads = [np.empty(X.shape, pr.input) for X in (Q, K, V)]
    for d in range(plan.size):
        grads[0][..., plan.shards[d], :] = dq[d]
        grads[1][..., plan.kv_shards[d], :], grads[2][..., plan.kv_shards[d], :] = home[d]
    return tuple(grads) + (() if score.dtable is None else (score.dtable,))


def ring_attention_simulate(Q, K, V, num_devices):
    """The one-process simulator contract: ``(output rounded to 4 decimals, comm_schedule)``.

    Device i owns rows [i*C, (i+1)*C) with C = seq_len // num_devices; at each
    of num_devices steps it attends to the K/V block it holds, then the blocks
    move to the next device. ``comm_schedule[step][device]`` is the source
    device of the block that device processes at that step.
    """
    Q, K, V = (_as_float(n, a) for n, a in (("Q", Q), ("K", K), ("V", V)))
    if Q.ndim != 2 or K.ndim != 2 or V.ndim != 2:
        raise ValueError(f"Q, K, V must be 2-D (seq_len, d), got {Q.shape}, {K.shape}, {V.shape}")
    if isinstance(num_devices, bool) or not isinstance(num_devices, (int, np.integer)) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    if Q.shape[0] % num_devices:
        raise ValueError(f"seq_len {Q.shape[0]} is not divisible by num_devices {num_devices}")
    out, _, schedule = simulate(Q, K, V, int(num_devices))
    return np.round(out, 4), schedule.sources()
