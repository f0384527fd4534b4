"""One rank's share of a KV cache as stored: tokens on the last axis in the kernel's form, quantized or not. No MPI.

``quantize`` stores the cache compressed and ``KVStore.tile`` dequantizes it one
tile (``TILE`` tokens) at a time:

- "float16": every value rounded to float16 (half the bytes of float32);
- "int8": per token and head, the values divided by their absmax / 127 and
  rounded; the scale kept in float32. Per token and head that is D + 4 bytes
  against 4 D for float32: 0.27 of it at D = 64.
"""

import numpy as np

from .tiles import max_abs

__all__ = ["KVStore", "QUANTIZE", "TILE", "ERROR_BOUND", "quantize"]

QUANTIZE = (None, "float16", "int8")
TILE = 4096  # cached tokens dequantized at a time by ``attend``
# largest error of a decode step against the float64 reference that the tests and ``generate`` accept, for
# standard-normal q, k, v (the errors measured: docs/inference.md)
ERROR_BOUND = {"float16": 1e-3, "int8": 2.5e-2}


def quantize(x, how):
    """``x`` (..., n, D) as stored: ``(values, scales)``; scales (..., n) float32 for int8, else None."""
    if how is None:
        return x, None
    if how == "float16":
        return x.astype(np.float16), None
    peak = np.abs(x).max(axis=-1)
    scales = np.where(peak > 0, peak / 127, 1).astype(np.float32)
    return np.rint(x / scales[..., None]).astype(np.int8), scales


def _grown(old, n, cap, shape, dtype, ones=False):
    """A store of ``shape + (cap,)`` holding ``old``'s first ``n`` tokens (last axis); ``ones``: one more row, all 1."""
    new = np.empty(shape[:-1] + (shape[-1] + 1, cap) if ones else shape + (cap,), dtype)
    if ones:
        new[..., -1, :] = 1
    if old is not None:
        new[..., :n] = old[..., :n]
    return new


class KVStore:
    """This rank's cached tokens: ``append`` them in position order, read them back a ``tile`` at a time.

    ``arrays``: [k values, k scales, v values, v scales], tokens on the last axis
    (None until the first ``append``); ``positions``: the tokens' global positions;
    ``lead``: the batch axes; ``k_peak``: max |k| so far (the logit check).
    """

    def __init__(self, kv_heads, head_dim, value_dim, dtype, quantize, shared=False):
        self.kv_heads, self.head_dim, self.value_dim, self.dtype = kv_heads, head_dim, value_dim, dtype
        self.quantize, self.shared = quantize, shared  # shared: v is k's last value_dim values, kept once
        self.arrays, self.lead, self.n, self.k_peak = None, None, 0, 0.0
        self._pos = np.empty(0, np.int64)

    @property
    def positions(self):
        """The global positions of the ``n`` tokens held, sorted (a view)."""
        return self._pos[:self.n]

    @property
    def nbytes(self):
        """Bytes of the tokens held as stored: values (unquantized: with the kernel's row of ones), scales."""
        if self.arrays is None:
            return 0
        return sum(a.nbytes // a.shape[-1] for a in self.arrays if a is not None) * self.n

    def append(self, k, v, positions):
        """Store new rows (position order, after the others), growing the arrays by doubling: no copy otherwise.

        Tokens lie on the last axis: k as (..., Hk, D, capacity) (unquantized: the
        kernel's [k | 1]^T, D + 1 rows, the last all ones), scales (..., Hk, capacity).
        """
        if self.arrays is None:
            self.lead = k.shape[:-3]
            self.arrays = [None] * 4
        n = k.shape[-2]
        need = self.n + n
        cap = self._pos.shape[0]
        if need > cap or self.arrays[0] is None:
            cap = max(need, 2 * cap, 16)
            for i, dim in ((0, self.head_dim),) + ((2, self.value_dim),) * (not self.shared):
                self.arrays[i] = _grown(self.arrays[i], self.n, cap, self.lead + (self.kv_heads, dim),
                                        {None: self.dtype, "float16": np.float16, "int8": np.int8}[self.quantize],
                                        ones=self.quantize is None)
                if self.quantize == "int8":
                    self.arrays[i + 1] = _grown(self.arrays[i + 1], self.n, cap, self.lead + (self.kv_heads,),
                                                np.float32)
            self._pos = np.concatenate([self._pos[:self.n], np.empty(cap - self.n, np.int64)])
        if n:
            self.k_peak = max(self.k_peak, max_abs(k))
        for i, x in ((0, k),) + ((2, v),) * (not self.shared):
            values, scales = quantize(x, self.quantize)
            self.arrays[i][..., :x.shape[-1], self.n:need] = np.swapaxes(values, -1, -2)
            if scales is not None:
                self.arrays[i + 1][..., self.n:need] = scales
        self._pos[self.n:need] = positions
        self.n = need

    def tile(self, a, b):
        """Tokens a:b as ``(kt, vt, positions)``: the kernel's padded form, in the cache's dtype.

        Unquantized: views of the arrays, no copy. Quantized: dequantized into new [x | 1]^T arrays.
        """
        if self.arrays is None:
            return (np.ones((self.kv_heads, self.head_dim + 1, 0), self.dtype),
                    np.ones((self.kv_heads, self.value_dim + 1, 0), self.dtype), self._pos[:0])
        tiles = []
        for i in (0, 2):
            if i == 2 and self.shared:  # [v | 1]^T: the last value_dim rows of [k | 1]^T and its ones, a view
                tiles.append(tiles[0][..., self.head_dim - self.value_dim:, :])
                break
            values = self.arrays[i][..., a:b]
            if self.quantize is None:
                tiles.append(values)
                continue
            out = np.empty(values.shape[:-2] + (values.shape[-2] + 1, b - a), self.dtype)
            out[..., :-1, :] = values
            if self.arrays[i + 1] is not None:
                out[..., :-1, :] *= self.arrays[i + 1][..., None, a:b]
            out[..., -1, :] = 1
            tiles.append(out)
        return tiles[0], tiles[1], self._pos[a:b]

    def tiles(self):
        """The tokens held, ``TILE`` at a time (``tile``); one empty tile when none."""
        return (self.tile(a, min(a + TILE, self.n)) for a in range(0, max(self.n, 1), TILE))

    def shard(self):
        """The tokens held as ``(k, v)`` dequantized, (..., Hk, n, D), in position order."""
        return tuple(np.swapaxes(t[..., :-1, :], -1, -2) for t in self.tile(0, self.n)[:2])
