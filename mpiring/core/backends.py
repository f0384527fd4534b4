"""The block kernel's backends: which code computes a K/V block's forward and backward. No MPI.

    attention_block(q, k, v, scale, klo, khi, padded=..., into=(out, lse))   # as kernels.attention_block
    attention_block_backward(dout, q, k, v, out, lse, scale, klo, khi, ...)  # as kernels.attention_block_backward

The block code (``mpiring.core.block``) calls these; they hand the block to the
backend in use, or to the NumPy kernel when that backend cannot compute it
exactly (its ``supports``). Backends (``MPIRING_KERNEL`` or ``set_backend``):

- ``numpy``: ``mpiring.core.kernels``, the tiled FlashAttention-2 in NumPy.
  The reference, always there, and what runs unless another is chosen.
- ``torch``: PyTorch's CPU flash-attention ops (``mpiring.core.tuning.torch_kernel``),
  when torch is installed; the blocks they cannot do exactly (V's head dim
  other than K's, scores too large for float tiles, non-finite inputs, an lse
  the backward refuses) go to the NumPy kernel.
- ``auto`` (the default): each block by ``AUTO_ROWS``, a fixed rule
  (docs/performance.md §19): torch's op for blocks of many query rows where torch is
  installed, the NumPy kernel for the rest (few rows, as in decoding, or
  float64 where NumPy's exp2 is vectorized). No tuning step and no timing at
  run time: a machine gives the same results for the same inputs run after
  run; backends differ from each other by rounding only (the same tolerances
  against the float64 reference). Torch is imported only for a call the rule
  gives to it (``prepare``, in every call's checks).

``calls`` counts the blocks each backend computed in this process (tests check
that the backend they chose did the work).
"""

from collections import Counter

import numpy as np

from . import kernels
from .tiles import PLAIN_RUN, kernel_dtype, with_moved
from .tuning import torch_kernel
from .tuning.machine import Choice, numpy_exp2_vectorized

__all__ = ["BACKENDS", "AUTO_ROWS", "available", "set_backend", "using", "backend", "choice", "for_block", "describe",
           "prepare", "takes_padded", "calls", "attention_block", "delta_is_rowsum", "attention_block_backward"]

BACKENDS = ("numpy", "torch")
calls = Counter()

# "auto": the fewest query rows of a block that torch's op computes, by whether NumPy's float32 exp2 runs vectorized
# here (its AVX-512 loop: without it NumPy's exp2, and so the NumPy kernel's softmax, is much slower), then by
# (compute dtype, pass); None: never. The measurements behind each entry: docs/performance.md §19.
AUTO_ROWS = {
    True: {("float32", "forward"): 512, ("float32", "backward"): 1024,
           ("float64", "forward"): None, ("float64", "backward"): None},
    False: {("float32", "forward"): 256, ("float32", "backward"): 512,
            ("float64", "forward"): 256, ("float64", "backward"): None},
}


def available():
    """The kernel backends this process can use."""
    return [name for name in BACKENDS if name == "numpy" or torch_kernel.available()]


_choice = Choice("kernel", "MPIRING_KERNEL", BACKENDS, available,
                 lambda name: f"kernel backend {name!r} needs PyTorch with its CPU flash-attention ops: "
                              "pip install torch (a CPU build)", None,
                 lambda: "auto" if torch_kernel.installed() else "numpy")
set_backend = _choice.set  # "numpy", "torch" or "auto" (``AUTO_ROWS``) for this process
using = _choice.using  # ``set_backend(name)`` inside a ``with`` block, the choice before it restored after
# what runs: "numpy", "torch", or "auto" (each block by ``AUTO_ROWS``, torch installed); resolving it imports nothing
# (a bad MPIRING_KERNEL: every rank's error, plans.checks.backend_problem)
backend = _choice.current


def choice():
    """What was chosen: a backend's name, or "auto"."""
    return _choice.choice


def for_block(dtype, rows, backward=False):
    """The backend that computes a block of ``rows`` query rows of ``dtype`` inputs: "numpy" or "torch"."""
    name = backend()
    if name != "auto":
        return name
    least = AUTO_ROWS[numpy_exp2_vectorized()].get((kernel_dtype(dtype).name, "backward" if backward else "forward"))
    return "torch" if least is not None and rows >= least else "numpy"


def describe():
    """The backend in use in words: its name, or "auto" and the blocks its rule gives torch (bench's header)."""
    name = backend()
    if name != "auto":
        return name
    rows = AUTO_ROWS[numpy_exp2_vectorized()]
    return "auto (torch's op for " + ", ".join(f"{dtype} {kind} blocks from {n} query rows"
                                               for (dtype, kind), n in rows.items() if n is not None) + ")"


def prepare(dtype, rows):
    """Load the backend that blocks of ``rows`` query rows of ``dtype`` inputs will use (torch's import takes
    seconds per rank: every call's checks spend it before the ring starts, not inside its first block)."""
    if "torch" in (for_block(dtype, rows), for_block(dtype, rows, backward=True)):
        torch_kernel.available()


def takes_padded(dtype, rows):
    """Whether the forward blocks of ``rows`` query rows of ``dtype`` inputs go to a kernel that takes K/V as
    [x | 1]^T (``padded=True``): the NumPy kernel does, so the ring keeps them so; torch's op takes (..., n, d)."""
    return for_block(dtype, rows) != "torch" or not torch_kernel.available()


def attention_block(q, k, v, scale=None, klo=None, khi=None, *, padded=False, into=None, run=PLAIN_RUN, **moved):
    """``kernels.attention_block`` by the backend in use (the NumPy kernel where it cannot; torch's op takes
    ``run.progress``, not its tiles). ``tile_q=``, ``tile_k=``, ``progress=``: deprecated, into ``run``."""
    run = with_moved(run, moved, "attention_block")
    q = np.asarray(q)
    if for_block(q.dtype, q.shape[-2]) == "torch" and torch_kernel.supports(q, k, v, scale, padded=padded):
        calls["torch"] += 1
        return torch_kernel.forward(q, k, v, scale, klo, khi, padded=padded, into=into, progress=run.progress)
    calls["numpy"] += 1
    return kernels.attention_block(q, k, v, scale, klo, khi, padded=padded, into=into, run=run)


def delta_is_rowsum(dout, q, out, delta):
    """Whether ``delta`` is rowsum(dout * out) up to rounding, for a backward whose blocks torch's op may take
    (on queries like ``q``), else None (not asked)."""
    q = np.asarray(q)
    if for_block(q.dtype, q.shape[-2], backward=True) != "torch":
        return None
    return torch_kernel.delta_matches(dout, out, delta)


def attention_block_backward(dout, q, k, v, out, lse, scale=None, klo=None, khi=None, *, delta=None, buffers=None,
                             run=PLAIN_RUN):
    """``kernels.attention_block_backward`` by the backend in use (the NumPy kernel where it cannot).

    The torch ops compute delta = rowsum(dout * out) themselves: a ``delta`` that differs from it by more
    than rounding (a loss that uses lse too: ``dlse`` enters as delta - dlse) takes the NumPy kernel.
    ``run.rowsum``: whether it is that rowsum, known for every row of the call (``delta_is_rowsum``); None:
    checked here on these rows."""
    q = np.asarray(q)
    if for_block(q.dtype, q.shape[-2], backward=True) == "torch" and torch_kernel.supports(q, k, v, scale, lse=lse) \
            and (torch_kernel.delta_matches(dout, out, delta) if run.rowsum is None else run.rowsum):
        calls["torch"] += 1
        return torch_kernel.backward(dout, q, k, v, out, lse, scale, klo, khi, progress=run.progress, buffers=buffers)
    calls["numpy"] += 1
    return kernels.attention_block_backward(dout, q, k, v, out, lse, scale, klo, khi, delta=delta, buffers=buffers,
                                            run=run)
