"""The sequence mixers' entry points: causal convolution and linear attention (with a decay, or the gated delta rule).

    mpiexec -n 4 python -c "..."   # see docs/mixers.md

    y = causal_conv(x, weight, bias, comm, seq_len=S, layout="zigzag")            # x (..., n, C) this rank's rows
    dx, dweight, dbias = causal_conv_backward(dy, x, weight, bias, comm, seq_len=S, layout="zigzag")
    out, carry = linear_attention(q, k, v, comm, decay=g, beta=beta, seq_len=S, passing="scan")
    dq, dk, dv, dg, dbeta = linear_attention_backward(dout, q, k, v, carry, comm, decay=g, beta=beta, ...)

Every entry point takes this rank's rows, ``timeout=`` and ``record=``, and
either ``spec=`` (a ``MixerSpec``) or its options as keywords (``seq_len``,
``layout``, ``positions``, ``cu_seqlens``, ``passing``, ``block``): one
``call.Run``. It runs one path: local checks, one agreement (the same ValueError on every rank),
the plan, then the mixer's loop over one ``MixerCall``. Rows given in any
order with ``positions=`` come back in that order. The gradients of weights
shared by every rank (the convolution's weight and bias; SSD's A and D) are
this rank's share: sum them over the ranks as any replicated parameter's.
"""

from typing import NamedTuple

import numpy as np

from ...core.mixers.conv import conv_rows, conv_rows_backward
from ...core.mixers.runs import corrected, reverse_element, run_backward, run_forward
from ...core.precision import compute_dtype, dtype_problem
from ...core.tuning.threads import limited, node_threads
from ...plans.checks import describe, is_real, shape_text
from ...plans.layouts import put_rows, sort_order, take_rows
from .call import Run, open_call
from .halo import exchange, home
from .passing import PASSING

__all__ = ["Refused", "causal_conv", "causal_conv_backward", "linear_attention", "linear_attention_backward", "Carry",
           "run_entry", "scan_forward", "scan_backward", "arrays_problem", "carry_problem", "gradient_problem",
           "made_by", "merged"]


class Carry(NamedTuple):
    """What a recurrence's forward hands its backward: per chunk of this rank, the state entering it, its
    transition and how its tokens read that state; and what made it (compared by the backward)."""

    incoming: list
    transitions: list
    entries: list
    made_by: tuple


class Refused(NamedTuple):
    """An argument an adapter could not hand over as an array, and why: reported through the agreement."""

    why: str


def arrays_problem(named):
    """Why these arrays (``{name: array or None}``) cannot be computed with, or None."""
    for name, a in named.items():
        if a is None:
            continue
        if isinstance(a, Refused):
            return a.why
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array, got {type(a).__name__}"
        if dtype_problem(name, a):
            return dtype_problem(name, a)
        if 0 in a.shape:
            return f"{name} must not be empty, got shape {a.shape}"
    return None


def run_entry(comm, rows, check, body, options, work=0.0):
    """The one path of every mixer call (collective): check, agree, plan, run ``body(call, **rows sorted)``.

    ``rows``: ``{name: (array or None, its sequence axis or None)}``; the first is the main one (its
    sequence length is this rank's). ``check(spec)``: this rank's problem or None. ``options``: the call's
    keywords (``Run.of``). ``body`` returns ``[(array, sequence axis or None), ...]``: rows go back to the
    caller's order.
    """
    problem, values, n_local = None, {}, 0
    try:
        run = Run.of(**options)
        problem = arrays_problem({name: a for name, (a, _) in rows.items()}) or check(run.spec)
        if problem is None:
            for name, (a, axis) in rows.items():
                values[f"{name} shape"] = None if a is None else shape_text(a, axis) if axis is not None \
                    else str(a.shape)
            main, axis = next(iter(rows.values()))
            values["dtype"], n_local = str(main.dtype), main.shape[axis]
            if run.spec.positions is not None and len(run.spec.positions) != n_local:
                problem = f"positions has {len(run.spec.positions)} entries for this rank's {n_local} rows"
    except Exception as exc:  # reported collectively, never raised alone
        problem, values = describe(exc), {}
        run = Run(None, options.get("timeout", "auto"), options.get("record"))
    call = open_call(comm, run, problem, values, n_local, work)
    with call, limited(node_threads()):  # BLAS threads: the node's cores shared among its ranks (threads="auto")
        order = sort_order(call.spec.positions)
        mine = {name: a if a is None or axis is None else take_rows(a, order, axis) for name, (a, axis) in
                rows.items()}
        results = body(call, **mine)
    return tuple(a if axis is None or a is None else put_rows(a, order, axis) for a, axis in results)


# ---------------------------------------------------------------- causal convolution


def _conv_problem(x, weight, bias):
    if x.ndim < 2:
        return f"x must have shape (..., seq, channels), got {x.shape}"
    if weight.ndim != 2 or weight.shape[0] != x.shape[-1]:
        return f"weight must have shape (channels, width) = ({x.shape[-1]}, width), got {weight.shape}"
    if bias is not None and bias.shape != (x.shape[-1],):
        return f"bias must have shape ({x.shape[-1]},), got {bias.shape}"
    return None


def _conv_rows(call, x, weight):
    halo = call.plan.halo(weight.shape[1], call.rank)
    work = compute_dtype(x.dtype)
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1]).astype(work, copy=False)
    received = exchange(call, np.ascontiguousarray(x3), halo)
    src = np.concatenate([x3, received, np.zeros((x3.shape[0], 1, x3.shape[-1]), work)], axis=1)
    return halo, src, work


def causal_conv(x, weight, bias=None, comm=None, **options):
    """This rank's y (shaped as x): y_t = bias + sum_j weight[:, j] x_{t-w+1+j}, zero before its document.

    x: (..., n, C) this rank's rows; weight (C, w); bias (C,) or None. Collective.
    """
    def body(call, x, weight, bias):
        halo, src, work = _conv_rows(call, x, weight)
        y = conv_rows(src, halo.taps, weight.astype(work), None if bias is None else bias.astype(work))
        return [(y.reshape(x.shape).astype(x.dtype, copy=False), -2)]

    rows = {"x": (x, -2), "weight": (weight, None), "bias": (bias, None)}
    return run_entry(comm, rows, lambda spec: _conv_problem(x, weight, bias), body, options,
                     work=4.0 * np.size(x) * np.shape(weight)[-1])[0]


def causal_conv_backward(dy, x, weight, bias=None, comm=None, **options):
    """``(dx, dweight, dbias)`` of ``causal_conv``: the halo rows' gradients go home to their holders;
    dweight and dbias are this rank's share (dbias None without a bias). Collective."""
    def body(call, dy, x, weight, bias):
        halo, src, work = _conv_rows(call, x, weight)
        dy3 = dy.reshape(src.shape[0], -1, src.shape[-1]).astype(work, copy=False)
        dsrc, dweight, dbias = conv_rows_backward(dy3, src, halo.taps, weight.astype(work), bias)
        n = dy3.shape[1]
        dx = dsrc[:, :n] + home(call, np.ascontiguousarray(dsrc[:, n:n + halo.rows]), halo, n)
        return [(dx.reshape(x.shape).astype(x.dtype, copy=False), -2), (dweight.astype(weight.dtype), None),
                (None if bias is None else dbias.astype(bias.dtype), None)]

    rows = {"dy": (dy, -2), "x": (x, -2), "weight": (weight, None), "bias": (bias, None)}
    return run_entry(comm, rows, lambda spec: _conv_problem(x, weight, bias) or gradient_problem("dy", dy, x, "x"),
                     body, options, work=8.0 * np.size(x) * np.shape(weight)[-1])


# ---------------------------------------------------------------- linear recurrences


def scan_forward(call, q, k, v, g, beta, made_by):
    """Outputs (Z, n, dv) and the ``Carry`` of the recurrence over this rank's chunks (arrays (Z, n, ...))."""
    block = call.spec.block
    chunks = call.plan.mine(call.rank)
    local = [run_forward(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], None if g is None else g[:, lo:hi],
                         None if beta is None else beta[:, lo:hi], block) for _, lo, hi in chunks]
    incoming = PASSING[call.spec.passing](call, call.plan.chain(), [piece.map for piece in local])
    out = np.empty(v.shape, v.dtype)
    for (_, lo, hi), piece, state in zip(chunks, local, incoming):
        out[:, lo:hi] = corrected(piece, state)
    return out, Carry(incoming, [piece.map.A for piece in local], [piece.entry for piece in local], made_by)


def scan_backward(call, dout, q, k, v, g, beta, carry):
    """Gradients (dq, dk, dv, dg, dbeta) over this rank's chunks: the states' gradients pass in reverse order."""
    chunks = call.plan.mine(call.rank)
    elements = [reverse_element(A, entry, dout[:, lo:hi])
                for (_, lo, hi), A, entry in zip(chunks, carry.transitions, carry.entries)]
    outgoing = PASSING[call.spec.passing](call, call.plan.chain(reverse=True), elements[::-1])[::-1]
    grads = [np.zeros_like(a) if a is not None else None for a in (q, k, v, g, beta)]
    for (_, lo, hi), state, dstate in zip(chunks, carry.incoming, outgoing):
        part = run_backward(dout[:, lo:hi], q[:, lo:hi], k[:, lo:hi], v[:, lo:hi],
                            None if g is None else g[:, lo:hi], None if beta is None else beta[:, lo:hi],
                            state, dstate, call.spec.block)
        for grad, piece in zip(grads, part):
            if grad is not None:
                grad[:, lo:hi] = piece
    return grads


def _linear_problem(q, k, v, decay, beta, scale):
    if q.ndim < 2 or q.shape != k.shape or v.ndim != q.ndim or v.shape[:-1] != q.shape[:-1]:
        return f"q and k must have one shape (..., seq, dk) and v (..., seq, dv), got {q.shape}, {k.shape}, {v.shape}"
    if not (q.dtype == k.dtype == v.dtype):
        return f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    if decay is not None and decay.shape not in (q.shape[:-1], q.shape):
        return (f"decay must have shape {q.shape[:-1]} (one log decay per head and token) or {q.shape} (one per "
                f"key dimension), got {decay.shape}")
    if beta is not None:
        if beta.shape != q.shape[:-1]:
            return f"beta must have shape {q.shape[:-1]} (one per head and token), got {beta.shape}"
        if decay is not None and decay.shape != q.shape[:-1]:
            return "the gated delta rule (beta) takes one decay per head and token, not one per key dimension"
    if scale is not None and not (is_real(scale) and np.isfinite(scale) and scale > 0):
        return f"scale must be a finite positive number, got {scale!r}"
    return None


def merged(a, keep):
    """``a`` with its leading axes merged: (Z, ...) keeping its last ``keep`` axes."""
    return None if a is None else a.reshape((-1,) + a.shape[a.ndim - keep:])


def _linear_rows(q, k, v, decay, beta, scale):
    """The scale and the recurrence's arrays (Z, n, ...) in the compute dtype, q scaled."""
    work = compute_dtype(q.dtype)
    s = 1.0 / np.sqrt(q.shape[-1]) if scale is None else float(scale)
    keep = decay.ndim - q.ndim + 2 if decay is not None else 0
    return s, [merged(a if a is None else a.astype(work, copy=False), n) for a, n in
               ((q * s, 2), (k, 2), (v, 2), (decay, keep), (beta, 1))]


def made_by(spec, *shapes):
    return (repr(sorted(spec.shown().items())),) + tuple(None if s is None else tuple(s) for s in shapes)


def gradient_problem(name, d, like, what):
    """Why the gradient ``d`` (``name``) does not have the shape of ``like`` (``what``), or None."""
    if getattr(d, "shape", None) != like.shape:
        return f"{name} must have the shape of {what} {like.shape}, got {getattr(d, 'shape', type(d).__name__)}"
    return None


def carry_problem(carry, spec, *shapes):
    """Why ``carry`` is not what this rank's forward with ``spec`` and these shapes returned, or None."""
    if not isinstance(carry, Carry):
        return f"carry must be what the forward returned, got {type(carry).__name__}"
    if carry.made_by != made_by(spec, *shapes):
        return "carry was made by a forward with other options or shapes than this backward's"
    return None


def linear_attention(q, k, v, comm=None, *, decay=None, beta=None, scale=None, **options):
    """This rank's ``(out, carry)`` of linear attention: S_t = a_t S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    q, k (..., n, dk); v (..., n, dv). ``decay``: log decays, None (a_t = 1), (..., n) (one per head:
    a_t = exp(decay_t)) or (..., n, dk) (one per key dimension: GLA). ``beta`` (..., n): the gated delta
    rule, S_t = a_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T. ``scale``: None, 1/sqrt(dk).
    ``carry``: what ``linear_attention_backward`` needs. Collective.
    """
    def body(call, q, k, v, decay, beta):
        _, flat = _linear_rows(q, k, v, decay, beta, scale)
        out, carry = scan_forward(call, *flat, made_by(call.spec, q.shape, v.shape, _shape(decay), _shape(beta)))
        return [(out.reshape(v.shape).astype(v.dtype, copy=False), -2), (carry, None)]

    rows = {"q": (q, -2), "k": (k, -2), "v": (v, -2), "decay": (decay, _decay_axis(q, decay)), "beta": (beta, -1)}
    return run_entry(comm, rows, lambda spec: _linear_problem(q, k, v, decay, beta, scale), body, options,
                     work=_scan_work(q, v, beta))


def linear_attention_backward(dout, q, k, v, carry, comm=None, *, decay=None, beta=None, scale=None, **options):
    """``(dq, dk, dv, ddecay, dbeta)`` of ``linear_attention`` (None for what was not given), from the same
    arguments and the forward's ``carry``. Collective."""
    def check(spec):
        return (_linear_problem(q, k, v, decay, beta, scale) or gradient_problem("dout", dout, v, "v")
                or carry_problem(carry, spec, q.shape, v.shape, _shape(decay), _shape(beta)))

    def body(call, dout, q, k, v, decay, beta):
        s, flat = _linear_rows(q, k, v, decay, beta, scale)
        dq, dk, dv, dg, dbeta = scan_backward(call, merged(dout.astype(flat[0].dtype, copy=False), 2), *flat, carry)
        return [((dq * s).reshape(q.shape).astype(q.dtype, copy=False), -2),
                (dk.reshape(k.shape).astype(k.dtype, copy=False), -2),
                (dv.reshape(v.shape).astype(v.dtype, copy=False), -2),
                (None if dg is None else dg.reshape(decay.shape).astype(decay.dtype, copy=False),
                 _decay_axis(q, decay)),
                (None if dbeta is None else dbeta.reshape(beta.shape).astype(beta.dtype, copy=False), -1)]

    rows = {"dout": (dout, -2), "q": (q, -2), "k": (k, -2), "v": (v, -2), "decay": (decay, _decay_axis(q, decay)),
            "beta": (beta, -1)}
    return run_entry(comm, rows, check, body, options, work=3 * _scan_work(q, v, beta))


def _shape(a):
    return None if a is None else a.shape


def _decay_axis(q, decay):
    """The sequence axis of the decay: -1 for one per head, -2 for one per key dimension."""
    return None if decay is None else (-2 if np.ndim(decay) == np.ndim(q) else -1)


def _scan_work(q, v, beta):
    """Floating-point operations of a recurrence over this rank's rows, generously (for timeout="auto")."""
    dk, dv = np.shape(q)[-1], np.shape(v)[-1]
    return 16.0 * np.size(q) * (dv + (dk if beta is not None else 0)) * 64
