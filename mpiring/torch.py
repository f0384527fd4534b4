"""Ring attention as a PyTorch autograd function, on CPU tensors (the optional ``torch`` extra).

    import mpiring, mpiring.torch
    ring = mpiring.Ring(comm, seq_len, causal=True, layout="zigzag", seq_axis=-3)  # (B, S, H, D) tensors
    out = mpiring.torch.ring_attention(q, k, v, ring)   # forward ring now
    loss.backward()                                      # backward ring when autograd reaches it

Tensors and NumPy arrays share memory both ways (``Tensor.numpy()``,
``torch.from_numpy``): nothing is copied on the way in or out, except what
the ring copies anyway to make a strided input contiguous. bfloat16, float16,
float32 and float64 tensors on the CPU (bfloat16 shares its memory as
``ml_dtypes.bfloat16``, the ``half`` extra). Half inputs compute their tiles
in float32 as the NumPy path does: out and the gradients come back in the
input dtype, lse in float32. Every rank must run the same graph: the backward of each
attention call is collective, as its forward is.
"""

import inspect

import numpy as np
import torch

from .core.precision import named_dtype
from .handle import ring_attention as _ring_attention
from .handle import ring_attention_backward as _ring_attention_backward
from .mpi.axes import seq_index
from .mpi.checks import Shown
from .options import foreign_problem
from .plans.content import content

__all__ = ["ring_attention", "DTYPES"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # bfloat16 through ml_dtypes
FUNCTION_OPTIONS = set(inspect.signature(_ring_attention).parameters) - {"q", "k", "v", "problem"}
BACKWARD_OPTIONS = set(inspect.signature(_ring_attention_backward).parameters)


def _numpy(t, name):
    """``(array, None)``: a tensor's memory as a NumPy array (no copy), or ``(None, why not)``."""
    if not isinstance(t, torch.Tensor):
        return None, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.device.type != "cpu":
        return None, f"{name} is on {t.device}: mpiring computes on the CPU; move it with .cpu() first"
    if t.dtype not in DTYPES:
        return None, (f"{name} is {t.dtype}: mpiring.torch takes bfloat16, float16, float32 and float64 CPU "
                      f"tensors; convert it with .float() or .double()")
    if t.dtype == torch.bfloat16:  # the same memory, seen as ml_dtypes' bfloat16
        try:
            return t.detach().view(torch.int16).numpy().view(named_dtype("bfloat16")), None
        except ValueError as exc:  # ml_dtypes is not installed
            return None, f"{name} is torch.bfloat16: {exc}"
    return t.detach().numpy(), None


def _tensor(a):
    """A NumPy array as a tensor sharing its memory (ml_dtypes' bfloat16 as torch.bfloat16)."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _arrays(tensors, names):
    """The tensors as NumPy arrays and the first problem found (arrays None then)."""
    found = [_numpy(t, name) for t, name in zip(tensors, names)]
    problem = next((why for _, why in found if why), None)
    return [None if problem else a for a, _ in found], problem


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, options, problem, shared):
        arrays, found = _arrays((q, k, v), "qkv")
        problem = problem or found  # reported by every rank, through the call's agreement
        if ring is not None:
            out, lse, *top = ring.forward(*arrays, problem=problem, shared=shared, **options)
        else:
            out, lse, *top = _ring_attention(*arrays, problem=problem, shared=shared, **options)
        out_t = _tensor(out)
        ctx.save_for_backward(q, k, v, out_t)
        ctx.ring, ctx.options, ctx.lse = ring, options, lse  # lse as returned: it carries the forward's options
        ctx.set_materialize_grads(False)
        top = torch.from_numpy(top[0]) if top else torch.empty(0)  # the max logit, when asked for
        ctx.mark_non_differentiable(top)
        return out_t, _tensor(lse), top

    @staticmethod
    def backward(ctx, dout, dlse, _):
        q, k, v, out = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        arrays, problem = _arrays((dout, q, k, v, out), ("the gradient of out", "q", "k", "v", "out"))
        dlse, found = (None, None) if dlse is None else _numpy(dlse, "the gradient of lse")
        if ctx.ring is not None:
            grads = ctx.ring.backward(*arrays, ctx.lse, dlse=dlse, problem=problem or found)
        else:
            options = {name: value for name, value in ctx.options.items() if name in BACKWARD_OPTIONS}
            grads = _ring_attention_backward(*arrays, ctx.lse, dlse=dlse, problem=problem or found, **options)
        return (*(_tensor(g) for g in grads[:3]), None, None, None, None)  # the Ring's own sinks: no tensor


def _with_sinks(out, lse, sinks, ring, options):
    """Trainable sinks (gpt-oss): each head's logit joins every row's denominator once, in torch ops after the
    ring, so autograd gives d loss / d sinks, and the ring's backward gets the matching dout and dlse."""
    seq_axis = ring.seq_axis if ring is not None else options.get("seq_axis", -2)
    lse_f = torch.logaddexp(lse, sinks.to(lse.dtype)[:, None].expand(lse.shape[-2:]))
    shrink = torch.exp(lse - lse_f).unsqueeze(-1)  # (..., H, n, 1) in the ring's (..., H, n, D) order
    shrink = torch.movedim(shrink, -2, seq_index(seq_axis, out.ndim))
    return out * shrink.to(out.dtype), lse_f


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring=None, *, return_lse: bool = False,
                   sinks: torch.Tensor | None = None, **options):
    """Context-parallel attention of this rank's q, k, v tensors, differentiable.

    ``ring``: an ``mpiring.Ring`` (agreed once, its options and ``seq_axis``
    used); ``options`` may repeat the Ring's own (``scale=``, ``causal=``,
    ..., as a model passes them at every call): equal values are accepted, a
    differing one raises ValueError on every rank. Or ``ring`` None, and
    ``options`` are those of ``mpiring.ring_attention`` (``comm``, ``causal``,
    ``layout``, ...), agreed at every call. An option mpiring does not have
    (``attn_mask``, ``dropout_p``, ...) or a tensor it cannot take (integer,
    on a GPU) raises ValueError on every rank, saying what is supported.
    Returns ``out``, or ``(out, lse)`` with ``return_lse=True``; gradients
    flow through both (lse's enters the backward as ``delta - dlse``). With
    ``return_max_logit=True`` (a Ring's or an option) the max logit follows, not differentiable.
    ``sinks``: a tensor of one logit per query head, trainable (gpt-oss): its gradient flows back to it,
    each rank's the share of its own rows (all-reduce it with the other replicated parameters' gradients,
    as ``mpiring.hf.all_reduce_gradients`` does); fixed sinks can be a Ring's option instead (docs/masks.md).
    """
    unknown = [name for name in options if name not in FUNCTION_OPTIONS]
    problem = foreign_problem(unknown[0], "the options of a Ring go to mpiring.Ring(...)" if ring is not None else
                              "without a Ring, this call takes those of mpiring.ring_attention") if unknown else None
    options = {name: value for name, value in options.items() if name not in unknown}
    if sinks is not None and problem is None:
        problem = _sinks_problem(sinks, q, ring, options)
    out, lse, top = _RingAttention.apply(q, k, v, ring, options, problem, _shared(q, k, v, sinks, problem))
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks, ring, options)
    results = (out, lse) if return_lse else (out,)
    results += (top,) if top.numel() else ()
    return results if len(results) > 1 else out


def _shared(q, k, v, sinks, problem):
    """What every rank's call must have alike beside the arrays: whether a backward follows (autograd calls it on
    the ranks whose output needs a gradient: all or none), and the trainable sinks, by content."""
    tensors = [t for t in (q, k, v, sinks) if isinstance(t, torch.Tensor)]
    shared = {"requires_grad": Shown(torch.is_grad_enabled() and any(t.requires_grad for t in tensors))}
    if sinks is not None and problem is None:
        shared["sinks tensor"] = Shown(None, f"{sinks.dtype} ({len(sinks)},)", content(sinks.detach(), "sinks tensor"))
    return shared


def _sinks_problem(sinks, q, ring, options):
    """Why a call's trainable ``sinks`` cannot be used, or None."""
    if not isinstance(sinks, torch.Tensor) or sinks.ndim != 1 or not sinks.is_floating_point():
        return f"sinks must be a 1-D floating-point tensor of one logit per query head, got {sinks!r:.80}"
    if not bool(torch.isfinite(sinks.detach()).all()):
        bad = int((~torch.isfinite(sinks.detach())).sum())
        return f"sinks must be finite logits, one per query head; got {bad} NaN/Inf of {len(sinks)}"
    if (ring is not None and ring.spec.sinks is not None) or options.get("sinks") is not None:
        return "sinks are given twice: as the Ring's (or an option's) fixed logits and as the call's tensor"
    seq_axis = ring.seq_axis if ring is not None else options.get("seq_axis", -2)
    try:
        shape = list(q.shape)
        shape.insert(len(shape) - 1, shape.pop(seq_index(seq_axis, q.ndim)))  # the sequence on axis -2
    except (TypeError, ValueError):
        return None  # the call's own check names the bad axis
    heads = shape[-3] if len(shape) > 2 else 1
    if len(sinks) != heads:
        return f"sinks has {len(sinks)} logits, but q has {heads} query heads: give one per head"
    return None
