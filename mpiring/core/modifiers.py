"""Score modifiers beyond softcap and a fixed bias: any elementwise ``score_mod`` with its derivative, and learnable
bias tables (``TableBias``, T5's relative position buckets) whose gradient the backward returns. No MPI.

A ``score_mod`` is flex_attention's: ``fn(score, batch, head, q_pos, k_pos)`` on
broadcast integer arrays, elementwise in ``score``. The kernel (``core.scores``)
calls it on one tile at a time with ``score`` of shape (batch, heads, queries,
keys); ``batch`` (B, 1, 1, 1) holds the flat index of the batch entry (q's
leading axes flattened), ``head`` (1, H, 1, 1) the global query heads, ``q_pos``
(1, 1, n, 1) and ``k_pos`` (1, 1, 1, m) the global positions. Its derivative
``score_mod_grad`` takes the same arguments and returns d fn / d score.
"""

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Modifiers", "NO_MODIFIERS", "TableBias", "relative_buckets", "t5_bias", "tile_indices", "mod_values"]


@dataclass(frozen=True, eq=False)
class Modifiers:
    """The score modifiers of a call, as the spec's fields of the same names (``plans.spec.SCORE_FIELDS``)."""

    softcap: float | None = None
    bias: object = None  # fn(heads, q_pos, k_pos), or a TableBias
    score_mod: object = None  # fn(score, batch, head, q_pos, k_pos)
    score_mod_grad: object = None  # its derivative d score_mod / d score
    sinks: object = None  # one logit per query head
    dropout: float = 0.0
    seed: int = 0


NO_MODIFIERS = Modifiers()


class TableBias:
    """A learnable bias ``table[head, index_fn(q_pos, k_pos)]``: ``table`` (heads, n_buckets) of real numbers (a
    NumPy array or a CPU torch tensor, read where it lives), ``index_fn`` giving integer bucket ids in
    0..n_buckets-1. The backward sums d loss / d bias into d table, bucket by bucket."""

    def __init__(self, table, index_fn):
        if not callable(index_fn):
            raise ValueError(f"TableBias needs index_fn(q_pos, k_pos) -> bucket ids, got {index_fn!r}")
        shape = tuple(getattr(table, "shape", np.shape(table)))
        if len(shape) != 2:
            raise ValueError(f"TableBias's table must have shape (heads, n_buckets), got {shape}")
        self.table, self.index_fn = table, index_fn

    def __repr__(self):
        name = getattr(self.index_fn, "__qualname__", type(self.index_fn).__qualname__)
        return f"TableBias({tuple(self.shape)} table, {name})"

    @property
    def shape(self):
        return tuple(self.table.shape)

    def values(self):
        """The table as float64 NumPy (a torch tensor's values, detached)."""
        table = self.table.detach() if hasattr(self.table, "detach") else self.table
        return np.asarray(table, np.float64)

    def buckets(self, q_pos, k_pos):
        """``index_fn(q_pos, k_pos)`` as int64; ValueError unless integers in 0..n_buckets-1."""
        ids = np.asarray(self.index_fn(q_pos, k_pos))
        if ids.dtype.kind not in "iu":
            raise ValueError(f"index_fn must return integer bucket ids, got {ids.dtype}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.shape[1]):
            raise ValueError(f"index_fn returned bucket ids {int(ids.min())}..{int(ids.max())}, outside the "
                             f"table's 0..{self.shape[1] - 1}")
        return ids.astype(np.int64)

    def __call__(self, heads, q_pos, k_pos):
        return self.values()[heads, self.buckets(q_pos, k_pos)]

    def read(self):
        """This bias over its table as read now, float64 NumPy: one call's, which reads the table once."""
        return TableBias(self.values(), self.index_fn)

    def add_grad(self, into, dbias, heads, q_pos, k_pos, ids=None):
        """Add d loss / d bias ``dbias`` (len(heads), n, m), summed over the batch, into ``into`` (the table's
        shape), bucket by bucket: row ``heads[i]`` gets dbias[i]'s entries summed per bucket id. ``ids``: the
        bucket ids of these positions when known (``buckets``)."""
        ids = self.buckets(q_pos[:, None], k_pos[None, :]) if ids is None else ids
        ids = np.broadcast_to(ids, (1,) + dbias.shape[-2:]).reshape(-1)
        for i, h in enumerate(heads):
            into[h] += np.bincount(ids, weights=dbias[i].reshape(-1), minlength=self.shape[1])


def relative_buckets(q_pos, k_pos, bidirectional=True, num_buckets=32, max_distance=128):
    """T5's relative position bucket of key ``k_pos`` for query ``q_pos`` (Raffel et al.; the buckets of
    transformers' ``T5Attention._relative_position_bucket``): exact distances below half the buckets, then
    logarithmic up to ``max_distance``; ``bidirectional``: keys after the query get buckets of their own."""
    rel = np.asarray(k_pos, np.int64) - np.asarray(q_pos, np.int64)
    buckets = np.zeros(rel.shape, np.int64)
    if bidirectional:
        num_buckets //= 2
        buckets += (rel > 0) * num_buckets
        rel = np.abs(rel)
    else:
        rel = -np.minimum(rel, 0)
    exact = num_buckets // 2
    ratio = np.maximum(rel, 1).astype(np.float32) / np.float32(exact)  # float32, as the model computes it
    far = exact + (np.log(ratio) / np.float32(math.log(max_distance / exact)) * np.float32(num_buckets - exact))
    far = np.minimum(far.astype(np.int64), num_buckets - 1)
    return buckets + np.where(rel < exact, rel, far)


def t5_bias(table, bidirectional=True, max_distance=128):
    """T5's relative attention bias: a ``TableBias`` over ``table`` (heads, num_buckets) with ``relative_buckets``."""
    def t5_buckets(q_pos, k_pos):
        return relative_buckets(q_pos, k_pos, bidirectional, int(table.shape[1]), max_distance)
    return TableBias(table, t5_buckets)


def tile_indices(batch, heads, q_pos, k_pos):
    """The broadcast arguments of a score_mod for a tile: (batch entries, heads, queries, keys) axes."""
    return (np.arange(batch).reshape(-1, 1, 1, 1), np.asarray(heads).reshape(1, -1, 1, 1),
            np.asarray(q_pos).reshape(1, 1, -1, 1), np.asarray(k_pos).reshape(1, 1, 1, -1))


def mod_values(fn, s, indices, finite=False):
    """``fn(s, *indices)`` broadcast to s's shape (ValueError naming the shape, or non-real or, with ``finite``,
    NaN values)."""
    got = np.asarray(fn(s, *indices))
    if got.dtype.kind not in "fiu":
        raise ValueError(f"it returned {got.dtype} values; it must return real numbers")
    try:
        got = np.broadcast_to(got, s.shape)
    except ValueError:
        raise ValueError(f"it returned shape {got.shape}, which does not broadcast to the tile's (batch, heads, "
                         f"queries, keys) = {s.shape}") from None
    if finite and np.isnan(got).any():
        raise ValueError(f"it returned {int(np.isnan(got).sum())} NaN values (check_finite=True)")
    return got
