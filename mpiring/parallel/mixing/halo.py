"""A causal convolution's halo: the rows before each chunk come from whichever rank holds them, and their
gradients go back home.

    rows = exchange(call, x, halo)             # (Z, halo.rows, C), in the order halo.taps reads them
    dx += home(call, dhalo, halo)              # the gradient of the rows this rank sent, from their readers

``halo`` is this rank's ``plans.chunks.Halo``: per peer, the rows it sends
and how many it receives. One message per peer each way; contiguous,
zigzag and striped chunks each get their own predecessors.
"""

import numpy as np

__all__ = ["exchange", "home"]

HALO_TAG, HOME_TAG = 21, 22


def exchange(call, x, halo):
    """The halo rows this rank reads (Z, rows, C), received from their holders."""
    buffers = {src: np.empty((x.shape[0], count, x.shape[-1]), x.dtype) for src, count in halo.recv.items()}
    call.swap([(dst, x[:, rows]) for dst, rows in halo.send.items()], buffers.items(), HALO_TAG,
              "the convolution's halo")
    if not buffers:
        return np.empty((x.shape[0], 0, x.shape[-1]), x.dtype)
    return np.concatenate([buffers[src] for src in sorted(buffers)], axis=1)


def home(call, dhalo, halo, n):
    """The gradient of this rank's own ``n`` rows that other ranks' halos read (Z, n, C): sent back by them."""
    shape = (dhalo.shape[0], n, dhalo.shape[-1])
    buffers = {dst: np.empty((shape[0], len(rows), shape[-1]), dhalo.dtype) for dst, rows in halo.send.items()}
    ends = np.cumsum([halo.recv[src] for src in sorted(halo.recv)], dtype=int)
    call.swap([(src, dhalo[:, end - halo.recv[src]:end]) for src, end in zip(sorted(halo.recv), ends)],
              buffers.items(), HOME_TAG, "the halo's gradient home")
    dx = np.zeros(shape, dhalo.dtype)
    for dst, rows in halo.send.items():
        dx[:, rows] += buffers[dst]
    return dx
