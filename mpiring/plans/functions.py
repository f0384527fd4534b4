"""Masks by any rule of positions: ``masks.function(fn)``, flex-attention's ``mask_mod`` evaluated with NumPy,
per (query, key) pair or per batch entry, head and pair. No MPI.

``fn(q_pos, k_pos)`` is one mask for every batch entry and head. ``fn(batch,
head, q_pos, k_pos)`` (flex's signature) may differ per batch entry and query
head; ``batch=`` and ``heads=`` say how many there are (as
``create_block_mask``'s B and H). The plan, its block skipping and the sparse
movement take the union over them (``allows``: every batch entry and head);
the kernel applies each one's own mask inside a block (``allows_at``: the
batch entries and heads it holds).
"""

import inspect

import numpy as np

from .content import described
from .visibility import MaskPiece

__all__ = ["Function"]


class Function(MaskPiece):
    """Any rule, NumPy on broadcast blocks of global positions (flex-attention's ``mask_mod``, vectorized):
    ``fn(q_pos, k_pos)``, or ``fn(batch, head, q_pos, k_pos)`` over ``batch`` (flattened) batch entries and
    ``heads`` query heads (``headed``). Must be the same function on every rank."""

    exact = False

    def __init__(self, fn, batch=None, heads=None):
        if not callable(fn):
            raise ValueError(f"function() takes a callable fn(q_pos, k_pos) or fn(batch, head, q_pos, k_pos) -> "
                             f"bool array, got {fn!r}")
        self.fn, self.arity = fn, _arity(fn)
        if self.arity == 4:
            for name, n in (("batch", batch), ("heads", heads)):
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                    raise ValueError(f"function(fn, batch=, heads=): fn {described(fn)} takes (batch, head, q_pos, "
                                     f"k_pos), so {name}= must give how many (a positive int, as "
                                     f"create_block_mask's B and H), got {n!r}")
            self.batch, self.heads = int(batch), int(heads)
        elif batch is not None or heads is not None:
            raise ValueError(f"function(fn, batch=, heads=) is for fn(batch, head, q_pos, k_pos); "
                             f"{described(fn)} takes (q_pos, k_pos)")

    headed = batched = property(lambda self: self.arity == 4)

    def counts(self):
        return (self.batch, self.heads) if self.headed else None

    def allows(self, q_pos, k_pos):
        if self.headed:
            return self.allows_at(self.batch, np.arange(self.heads), q_pos, k_pos)
        return self._checked(self.fn(q_pos, k_pos), np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos)))

    def allows_at(self, batch, heads, q_pos, k_pos):
        if not self.headed:
            return super().allows_at(batch, heads, q_pos, k_pos)
        b = np.arange(batch, dtype=np.int64).reshape(-1, 1, 1, 1)
        h = np.asarray(heads, np.int64).reshape(1, -1, 1, 1)
        qp, kp = np.asarray(q_pos)[None, None], np.asarray(k_pos)[None, None]
        shape = (batch, h.size) + np.broadcast_shapes(np.shape(q_pos), np.shape(k_pos))
        return self._checked(self.fn(b, h, qp, kp), shape)

    def _checked(self, ok, shape):
        ok = np.asarray(ok)
        if ok.dtype != bool:
            raise ValueError(f"the mask function {described(self.fn)} must return a bool array, got {ok.dtype}")
        try:
            return np.broadcast_to(ok, shape)
        except ValueError:
            raise ValueError(f"the mask function {described(self.fn)} returned shape {ok.shape} for positions "
                             f"broadcasting to {shape}") from None

    def __repr__(self):
        return f"Function({described(self.fn)})"


def _arity(fn):
    """2 or 4: the positional arguments a mask function takes (flex's mask_mod takes 4)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 2
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return 2
    n = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)
    if n not in (2, 4):
        raise ValueError(f"a mask function takes (q_pos, k_pos) or (batch, head, q_pos, k_pos); "
                         f"{described(fn)} takes {n} arguments")
    return n
