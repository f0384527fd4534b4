"""The lse a forward returns, and what it remembers: the options that made it, for the backward to check.

A backward with other options than its forward (a window forgotten, another
scale) would return wrong gradients without a sound; ``Lse`` carries the
forward's options with the values, and ``mismatch`` says what differs.
"""

import numpy as np

__all__ = ["Lse", "mismatch"]


class Lse(np.ndarray):
    """The log-sum-exp a forward returned: a NumPy array that remembers the options that made it.

    ``made_by`` (``Spec.made_by``, a dict: layout, mode, causal, window,
    cu_seqlens, seq_len, ranks, scale, wire dtype) travels with views, slices, copies and pickles; arithmetic
    on it gives plain arrays. A backward compares it with its own options.
    """

    made_by = None

    def __array_finalize__(self, obj):
        self.made_by = getattr(obj, "made_by", None)

    def __array_wrap__(self, array, context=None, return_scalar=False):
        array = array.view(np.ndarray)  # computed values are no longer the forward's lse
        return array[()] if return_scalar else array

    def __reduce__(self):
        rebuild, args, state = super().__reduce__()
        return rebuild, args, (state, self.made_by)

    def __setstate__(self, state):
        super().__setstate__(state[0])
        self.made_by = state[1]


def mismatch(lse, mine):
    """Why ``lse`` cannot come from a forward made as ``mine`` (``Spec.made_by``) says, or None (also if untagged)."""
    tag = getattr(lse, "made_by", None)
    if tag is None or tag.get("digest") == mine["digest"]:
        return None
    diffs = [f"{name}={tag.get(name)!r} there, {value!r} here" for name, value in mine.items()
             if tag.get(name) != value and name != "digest"]
    if not diffs:
        return None
    return (f"lse was made by a forward with other options ({'; '.join(diffs)}): the gradients would be wrong; "
            f"pass the forward's options to the backward, or use one mpiring.Ring for both")
