"""Ring attention as a PyTorch autograd function, on CPU tensors (the optional ``torch`` extra).

    import mpiring, mpiring.torch
    ring = mpiring.Ring(comm, seq_len, causal=True, layout="zigzag", seq_axis=-3)  # (B, S, H, D) tensors
    out = mpiring.torch.ring_attention(q, k, v, ring)   # forward ring now
    loss.backward()                                      # backward ring when autograd reaches it

Tensors and NumPy arrays share memory both ways (``Tensor.numpy()``,
``torch.from_numpy``): nothing is copied on the way in or out, except what
the ring copies anyway to make a strided input contiguous. float32 and float64
tensors on the CPU. Every rank must run the same graph: the backward of each
attention call is collective, as its forward is.
"""

import numpy as np
import torch

from .handle import ring_attention as _ring_attention
from .handle import ring_attention_backward as _ring_attention_backward

__all__ = ["ring_attention"]


def _numpy(t, name):
    """A tensor's memory as a NumPy array (no copy), or a clear error for what NumPy cannot share."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}: mpiring computes on the CPU; move it with .cpu() first")
    return t.detach().numpy()


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, options):
        arrays = [_numpy(t, name) for t, name in zip((q, k, v), "qkv")]
        out, lse = ring.forward(*arrays) if ring is not None else _ring_attention(*arrays, **options)
        out_t = torch.from_numpy(out)
        ctx.save_for_backward(q, k, v, out_t)
        ctx.ring, ctx.options, ctx.lse = ring, options, lse  # lse as returned: it carries the forward's options
        ctx.set_materialize_grads(False)
        return out_t, torch.from_numpy(np.asarray(lse))

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out = ctx.saved_tensors
        arrays = [_numpy(t, name) for t, name in zip((q, k, v), "qkv")]
        dout = np.zeros(out.shape, arrays[0].dtype) if dout is None else _numpy(dout, "the gradient of out")
        dlse = None if dlse is None else _numpy(dlse, "the gradient of lse")
        if ctx.ring is not None:
            grads = ctx.ring.backward(dout, *arrays, _numpy(out, "out"), ctx.lse, dlse=dlse)
        else:
            grads = _ring_attention_backward(dout, *arrays, _numpy(out, "out"), ctx.lse, dlse=dlse, **ctx.options)
        return (*(torch.from_numpy(g) for g in grads), None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring=None, *, return_lse: bool = False,
                   **options):
    """Context-parallel attention of this rank's q, k, v tensors, differentiable.

    ``ring``: an ``mpiring.Ring`` (agreed once, its options and ``seq_axis``
    used); or None, and ``options`` are those of ``mpiring.ring_attention``
    (``comm``, ``causal``, ``layout``, ...), agreed at every call. Returns
    ``out``, or ``(out, lse)`` with ``return_lse=True``; gradients flow
    through both (lse's enters the backward as ``delta - dlse``).
    """
    if ring is not None and options:
        raise TypeError(f"give the options to the Ring, not here: {sorted(options)}")
    out, lse = _RingAttention.apply(q, k, v, ring, options)
    return (out, lse) if return_lse else out
