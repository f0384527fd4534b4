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
from .options import foreign_problem

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
    def forward(ctx, q, k, v, ring, options, problem):
        arrays, found = _arrays((q, k, v), "qkv")
        problem = problem or found  # reported by every rank, through the call's agreement
        if ring is not None:
            out, lse = ring.forward(*arrays, problem=problem, **options)
        else:
            out, lse = _ring_attention(*arrays, problem=problem, **options)
        out_t = _tensor(out)
        ctx.save_for_backward(q, k, v, out_t)
        ctx.ring, ctx.options, ctx.lse = ring, options, lse  # lse as returned: it carries the forward's options
        ctx.set_materialize_grads(False)
        return out_t, _tensor(lse)

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        arrays, problem = _arrays((dout, q, k, v, out), ("the gradient of out", "q", "k", "v", "out"))
        dlse, found = (None, None) if dlse is None else _numpy(dlse, "the gradient of lse")
        if ctx.ring is not None:
            grads = ctx.ring.backward(*arrays, ctx.lse, dlse=dlse, problem=problem or found)
        else:
            options = {name: value for name, value in ctx.options.items() if name in BACKWARD_OPTIONS}
            grads = _ring_attention_backward(*arrays, ctx.lse, dlse=dlse, problem=problem or found, **options)
        return (*(_tensor(g) for g in grads), None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring=None, *, return_lse: bool = False,
                   **options):
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
    flow through both (lse's enters the backward as ``delta - dlse``).
    """
    unknown = [name for name in options if name not in FUNCTION_OPTIONS]
    problem = foreign_problem(unknown[0], "the options of a Ring go to mpiring.Ring(...)" if ring is not None else
                              "without a Ring, this call takes those of mpiring.ring_attention") if unknown else None
    options = {name: value for name, value in options.items() if name not in unknown}
    out, lse = _RingAttention.apply(q, k, v, ring, options, problem)
    return (out, lse) if return_lse else out
