"""The block kernel's backends: which code computes a K/V block's forward and backward. No MPI.

    attention_block(q, k, v, scale, klo, khi, padded=..., into=(out, lse))   # as kernels.attention_block
    attention_block_backward(dout, q, k, v, out, lse, scale, klo, khi, ...)  # as kernels.attention_block_backward

The block code (``mpiring.core.block``) calls these; they hand the block to the
backend in use, or to the NumPy kernel when that backend cannot compute it
exactly (its ``supports``). Backends (``MPIRING_KERNEL`` or ``set_backend``):

- ``numpy``: ``mpiring.core.kernels``, the tiled FlashAttention-2 in NumPy.
  The reference, always there, and what runs unless another is chosen.
- ``torch``: PyTorch's CPU flash-attention ops (``mpiring.core.torch_kernel``),
  when torch is installed; the blocks they cannot do exactly (V's head dim
  other than K's, scores too large for float tiles, non-finite inputs, an lse
  the backward refuses) go to the NumPy kernel.
- ``auto`` (the default): what ``python -m mpiring bench tune`` measured fastest on
  this CPU (its cache), else ``numpy``. So a machine gives the same results
  for the same inputs run after run; backends differ from each other by
  rounding only (the same tolerances against the float64 reference).

``calls`` counts the blocks each backend computed in this process (tests check
that the backend they chose did the work).
"""

from collections import Counter

from . import kernels, torch_kernel
from .machine import Choice

__all__ = ["BACKENDS", "available", "set_backend", "using", "backend", "choice", "takes_padded", "calls",
           "attention_block", "attention_block_backward"]

BACKENDS = ("numpy", "torch")
calls = Counter()


def available():
    """The kernel backends this process can use."""
    return [name for name in BACKENDS if name == "numpy" or torch_kernel.available()]


_choice = Choice("kernel", "MPIRING_KERNEL", BACKENDS, available,
                 lambda name: f"kernel backend {name!r} needs PyTorch with its CPU flash-attention ops: "
                              "pip install torch (a CPU build)", "kernel", lambda: "numpy")
set_backend = _choice.set  # "numpy", "torch" or "auto" (the tuning cache's choice) for this process
using = _choice.using  # ``set_backend(name)`` inside a ``with`` block, the choice before it restored after
backend = _choice.current  # the backend in use (a bad MPIRING_KERNEL: every rank's error, mpi.checks.backend_problem)


def choice():
    """What was chosen: a backend's name, or "auto" (``backend()`` says which backend that is)."""
    return _choice.choice


def takes_padded():
    """Whether the backend in use takes K/V blocks as [x | 1]^T (``padded=True``): the NumPy kernel does, so
    the ring keeps them so; torch's op takes them as (..., n, d)."""
    return backend() != "torch"


def attention_block(q, k, v, scale=None, klo=None, khi=None, *, padded=False, into=None, progress=None, **tiles):
    """``kernels.attention_block`` by the backend in use (the NumPy kernel where it cannot)."""
    if backend() == "torch" and torch_kernel.supports(q, k, v, scale, padded=padded):
        calls["torch"] += 1
        return torch_kernel.forward(q, k, v, scale, klo, khi, padded=padded, into=into, progress=progress)
    calls["numpy"] += 1
    return kernels.attention_block(q, k, v, scale, klo, khi, padded=padded, into=into, progress=progress, **tiles)


def attention_block_backward(dout, q, k, v, out, lse, scale=None, klo=None, khi=None, *, delta=None,
                             progress=None, buffers=None, **tiles):
    """``kernels.attention_block_backward`` by the backend in use (the NumPy kernel where it cannot).

    The torch ops compute delta = rowsum(dout * out) themselves: a ``delta`` that differs from it by more
    than rounding (a loss that uses lse too: ``dlse`` enters as delta - dlse) takes the NumPy kernel."""
    if backend() == "torch" and torch_kernel.supports(q, k, v, scale, lse=lse) \
            and torch_kernel.delta_matches(dout, out, delta):
        calls["torch"] += 1
        return torch_kernel.backward(dout, q, k, v, out, lse, scale, klo, khi, progress=progress, buffers=buffers)
    calls["numpy"] += 1
    return kernels.attention_block_backward(dout, q, k, v, out, lse, scale, klo, khi, delta=delta,
                                            progress=progress, buffers=buffers, **tiles)
