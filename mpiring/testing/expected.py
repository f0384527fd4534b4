"""The dense float64 reference and the tolerance table of the kit.

``reference`` / ``reference_backward``: attention and its gradients with the mask written directly
from the definitions (causal, sliding window, packed documents), grouped-query heads and arbitrary
query/key positions (a rank's shard against the whole sequence): the package's one plain reference
(``mpiring.core.reference``), independent of ``mpiring.plans.visibility``, the plan and the tiled
kernels, so it can check them.
"""

import numpy as np

from ..core.mla import expand
from ..core.reference import definition_mask, dense_attention, dense_attention_backward, scored_attention
from ..core.tuning.threads import limited, node_threads
from ..plans.spec import spec_problem

__all__ = ["TOLERANCE", "dense_mask", "latent_reference", "latent_reference_backward", "reference",
           "reference_backward", "tolerance"]

# Largest error allowed against the float64 reference (computed from the inputs as rounded to
# their dtype), per input dtype: absolute for outputs, relative to max(1, max|ref|) for gradients
# (what="dq", "dk", "dv", "grad..."). Half inputs (tiles in float32, results rounded to the half
# dtype once: about 2^-11 and 2^-8 of |out|); NumPy has no bfloat16: its row is looked up by the
# name "bfloat16" (ml_dtypes' dtype). K/V coded on the wire (``wire_dtype``, unit-normal inputs,
# head dims 8 to 128; int8 and FP8: per-token, per-head absmax scales): the error the coding adds, about
# 1.5x the largest that ``python -m mpiring bench accuracy --backward`` style sweeps measured at P = 2..8
# over masks down to 2 visible keys (docs/reliability.md 4b). FP8 rounds a value to 1/28 (e4m3) or 1/14
# (e5m2) of its row's absmax: a row that sees one remote key carries that error whole.
TOLERANCE = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 1e-2,
    "bfloat16": 3e-2,
    "float16 wire": 3e-3,
    "bfloat16 wire": 2e-2,
    "int8 wire": 4e-2,
    "float8_e4m3 wire": 0.2,
    "float8_e5m2 wire": 0.4,
}


def tolerance(dtype, wire=None, codings=1):
    """The TOLERANCE entry of a dtype (a NumPy dtype, a type like np.float32, or a name).

    With ``wire`` (a ``wire_dtype``: "float16", "bfloat16", "int8", "float8_e4m3", "float8_e5m2"): the larger of
    the dtype's and the wire's times ``codings``, the codings whose errors the result carries (2 for pass-Q's
    gradients: its forward coded the queries, then the backward the K/V), unless the wire is the dtype itself
    (half inputs travel as they are).
    """
    name = getattr(dtype, "name", None) or getattr(dtype, "__name__", None) or str(dtype)
    own = TOLERANCE["bfloat16"] if name == "bfloat16" else None
    if own is None:
        try:
            own = TOLERANCE[np.dtype(dtype)]
        except (KeyError, TypeError):
            raise KeyError(f"no tolerance for dtype {dtype!r}; TOLERANCE has {list(map(str, TOLERANCE))}") from None
    if wire is None or wire == name:
        return own
    if f"{wire} wire" not in TOLERANCE:
        raise KeyError(f"no tolerance for wire {wire!r}; TOLERANCE has {list(map(str, TOLERANCE))}")
    return max(own, codings * TOLERANCE[f"{wire} wire"])


# ---------------------------------------------------------------- the dense reference


def dense_mask(q_positions, k_positions, *, causal=False, window=None, cu_seqlens=None, causal_block=None, mask=()):
    """Boolean (len(q_positions), len(k_positions)) mask: True where query i may see key j.

    Straight from the definitions (``mpiring.core.reference.definition_mask``), with i, j global
    token positions: causal: j <= i (causal_block F: j // F <= i // F); window (left, right), -1 unbounded (flash-attn):
    i - left <= j <= i + right; cu_seqlens [0, e1, ..., S]: i and j in the same document.
    """
    if cu_seqlens is not None:
        bounds = np.asarray(cu_seqlens, np.int64)
        if bounds.ndim != 1 or len(bounds) < 2 or bounds[0] != 0 or np.any(np.diff(bounds) < 0):
            raise ValueError(f"cu_seqlens must be [0, e1, ..., S], non-decreasing; got {cu_seqlens!r}")
    return definition_mask(q_positions, k_positions, causal=causal, window=window, cu_seqlens=cu_seqlens,
                           causal_block=causal_block, mask=mask)


def _prepare(q, k, v, q_positions, k_positions, mask_options):
    """Check shapes and positions; the mask of rows a:b as ``dense_attention`` takes it."""
    q, k, v = (np.asarray(a) for a in (q, k, v))
    if q.ndim < 2 or k.ndim != q.ndim or v.ndim != q.ndim:
        raise ValueError(f"q, k, v must be (..., seq, dim) with the same number of axes; got "
                         f"{q.shape}, {k.shape}, {v.shape}")
    if q.ndim >= 3 and k.shape[-3] != q.shape[-3] and (k.shape[-3] == 0 or q.shape[-3] % k.shape[-3]):
        raise ValueError(f"q heads ({q.shape[-3]}) must be a multiple of k/v heads ({k.shape[-3]})")
    qp = np.arange(q.shape[-2]) if q_positions is None else np.asarray(q_positions)
    kp = np.arange(k.shape[-2]) if k_positions is None else np.asarray(k_positions)
    if len(qp) != q.shape[-2] or len(kp) != k.shape[-2]:
        raise ValueError(f"{len(qp)} query positions for {q.shape[-2]} queries, {len(kp)} key positions "
                         f"for {k.shape[-2]} keys")
    mask = dense_mask(qp, kp, **mask_options)
    return lambda a, b: mask[a:b]


def reference(q, k, v, *, spec=None, causal=False, q_positions=None, k_positions=None, **options):
    """Dense attention in float64: ``(out, lse)`` (``mpiring.core.reference.dense_attention``).

    q (..., Hq, Sq, D), k (..., Hk, Sk, D), v (..., Hk, Sk, Dv), Hq a multiple of Hk (head h uses
    K/V head h // (Hq/Hk)); 2-D (S, D) arrays work too. ``q_positions`` / ``k_positions`` are the
    global token positions of the rows (default arange), so a rank's queries can be checked against
    the whole sequence: ``reference(q_local, K, V, q_positions=shard_indices(S, P, rank), causal=True)``.
    Rows that see no key get out 0 and lse -inf. The default scale is 1/sqrt(D). BLAS threads
    are shared out among the ranks on this node during the call, as in ``ring_attention``.
    ``spec`` or ``options``: the mask (``causal``, ``window``, ``cu_seqlens``, ``causal_block``, ``mask``), the
    ``scale`` and the score modifiers as ``ring_attention`` takes them (``core.reference.scored_attention``,
    from their definitions; dropout's entries are global: pass the whole sequence's rows, or
    ``q_positions``, with the batch entries and heads of the call); ``return_max_logit``.
    """
    spec, masks, scores = _options(spec, dict(options, causal=causal))
    if _scored(masks, scores) or spec.return_max_logit:
        out, lse, top = _scored_call(q, k, v, q_positions, k_positions, masks, scores, spec.scale)
        return (out, lse, top) if spec.return_max_logit else (out, lse)
    rows = _prepare(q, k, v, q_positions, k_positions, masks)
    if np.shape(k)[-2] == 0:  # no keys (an empty shard): every row sees nothing
        lead = np.shape(q)[:-2]
        return np.zeros(lead + (np.shape(q)[-2], np.shape(v)[-1])), np.full(lead + (np.shape(q)[-2],), -np.inf)
    with limited(node_threads()):
        return dense_attention(q, k, v, spec.scale, rows)


def reference_backward(dout, q, k, v, *, spec=None, causal=False, q_positions=None, k_positions=None, **options):
    """Dense gradients of ``reference``'s output in float64: ``(dq, dk, dv)`` for the loss sum(dout * out).

    dP = dout v^T, dS = P * (dP - rowsum(dout * out)), dq = scale dS k, dk = scale dS^T q, dv = P^T dout;
    grouped-query K/V gradients are summed over the query heads that share them
    (``mpiring.core.reference.dense_attention_backward``). With ``sinks``: ``(dq, dk, dv, dsinks)``; with a
    ``TableBias`` bias, d table follows (``(dq, dk, dv[, dsinks], dtable)``, as ``Ring.backward``).
    Options as ``reference``'s.
    """
    spec, masks, scores = _options(spec, dict(options, causal=causal))
    if spec.backward_problem():
        raise ValueError(spec.backward_problem())
    if _scored(masks, scores):
        grads = _scored_call(q, k, v, q_positions, k_positions, masks, scores, spec.scale, dout)
        return grads[:3] + grads[3:4] * (spec.sinks is not None) + grads[4:]
    rows = _prepare(q, k, v, q_positions, k_positions, masks)
    with limited(node_threads()):
        return dense_attention_backward(dout, q, k, v, spec.scale, rows)


def _options(spec, options):
    """``(spec, mask options, score options)``: the options through ``Spec.of`` (ValueError naming a bad one)."""
    spec, problem = spec_problem(options, spec)
    if problem:
        raise ValueError(problem)
    masks = dict(causal=spec.causal, window=spec.window, cu_seqlens=spec.cu_seqlens, causal_block=spec.causal_block,
                 mask=spec.mask)
    return spec, masks, {name: getattr(spec, name)
                         for name in ("softcap", "bias", "score_mod", "score_mod_grad", "sinks", "dropout", "seed")}


def latent_reference(q, c_kv, k_rope, w_uk, w_uv, **options):
    """MLA in float64 (``mpiring.mla_attention``): the latent expanded per head (``core.mla.expand``), then
    ``reference`` with its options."""
    k, v = expand(c_kv, k_rope, w_uk, w_uv, np.float64)
    return reference(np.asarray(q, np.float64), k, v, **options)


def latent_reference_backward(dout, q, c_kv, k_rope, w_uk, w_uv, **options):
    """``(dq, dc_kv, dk_rope, dw_uk, dw_uv)`` of ``latent_reference`` in float64: ``reference_backward``'s per-head
    dk, dv taken back through the expansion, k_h = [c W_UK[h] | k_rope], v_h = c W_UV[h]."""
    f64 = [np.asarray(a, np.float64) for a in (dout, q, c_kv, w_uk, w_uv)]
    k, v = expand(c_kv, k_rope, w_uk, w_uv, np.float64)
    dq, dk, dv = reference_backward(f64[0], f64[1], k, v, **options)
    nope, c = dk[..., :w_uk.shape[-1]], f64[2][..., 0, :, :]
    dc = np.einsum("...hnd,hrd->...nr", nope, f64[3]) + np.einsum("...hnd,hrd->...nr", dv, f64[4])
    return (dq, dc[..., None, :, :], dk[..., w_uk.shape[-1]:].sum(axis=-3, keepdims=True),
            *(np.einsum("bnr,bhnd->hrd", c.reshape((-1,) + c.shape[-2:]), g.reshape((-1,) + g.shape[-3:]))
              for g in (nope, dv)))


def _scored(options, scores):
    """Whether the dense scored reference is needed: a score modifier, or a mask that differs per batch entry."""
    modified = any(scores[name] is not None for name in ("softcap", "bias", "score_mod", "sinks"))
    modified = modified or bool(scores["dropout"])
    return modified or any(p.batched for p in options["mask"])


def _scored_call(q, k, v, q_positions, k_positions, options, scores, scale, dout=None):
    _prepare(q, k, v, q_positions, k_positions, dict(options, mask=()))  # the shape checks
    qp = np.arange(np.shape(q)[-2]) if q_positions is None else np.asarray(q_positions, np.int64)
    kp = np.arange(np.shape(k)[-2]) if k_positions is None else np.asarray(k_positions, np.int64)
    flat = dict(options, mask=tuple(p for p in options["mask"] if not p.batched))
    allowed = dense_mask(qp, kp, **flat)
    for piece in options["mask"]:
        if piece.batched:  # (batch..., Sq, Sk): a head axis before the rows
            allowed = allowed & piece.allows(qp[:, None], kp[None, :])[..., None, :, :]
    with limited(node_threads()):
        return scored_attention(q, k, v, allowed, scale=scale, q_pos=qp, k_pos=kp, dout=dout, **scores)
