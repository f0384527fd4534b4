"""The lse a forward returns, and what it remembers: the options that made it, for the backward to check.

A backward with other options than its forward (a window forgotten, another
scale) would return wrong gradients without a sound; ``Lse`` carries the
forward's options with the values, and ``mismatch`` says what differs.
"""

import hashlib

import numpy as np

from .core.kernels import default_scale
from .mpi.checks import canonical, scale_problem

__all__ = ["Lse", "made_by", "plan_options", "mismatch", "lse_problem"]


class Lse(np.ndarray):
    """The log-sum-exp a forward returned: a NumPy array that remembers the options that made it.

    ``made_by`` (a dict: layout, mode, causal, window, cu_seqlens, seq_len,
    ranks, scale) travels with views, slices, copies and pickles; arithmetic
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


def made_by(options, size, scale, seq_len=None):
    """What a forward's lse depends on besides q, k, v (canonical ``options``): compared by the backward."""
    cu = options["cu_seqlens"]
    if cu is not None:
        cu = cu.tolist() if len(cu) <= 8 else f"{len(cu)} entries, sha1 {hashlib.sha1(cu.tobytes()).hexdigest()[:12]}"
    layout = "positions" if options.get("positions") is not None else options["layout"]
    tag = {"layout": layout, "mode": options["mode"], "causal": bool(options["causal"]),
           "window": tuple(options["window"]), "cu_seqlens": cu, "causal_block": options.get("causal_block"),
           "ranks": size, "scale": float(scale), "wire_dtype": options.get("wire_dtype")}
    if seq_len is not None:
        tag["seq_len"] = seq_len
    return tag


def plan_options(plan, precision):
    """The canonical options of a call under ``plan`` with the ``precision`` options."""
    return dict(layout=plan.layout, mode=plan.mode, causal=plan.causal, window=plan.window, cu_seqlens=plan.cu_seqlens,
                causal_block=plan.causal_block, **precision)


def mismatch(lse, mine):
    """Why ``lse`` cannot come from a forward made as ``mine`` (``made_by``) says, or None (also if untagged)."""
    tag = getattr(lse, "made_by", None)
    if tag is None:
        return None
    diffs = [f"{name}={tag.get(name)!r} there, {value!r} here" for name, value in mine.items()
             if tag.get(name) != value]
    if not diffs:
        return None
    return (f"lse was made by a forward with other options ({'; '.join(diffs)}): the gradients would be wrong; "
            f"pass the forward's options to the backward, or use one mpiring.Ring for both")


def lse_problem(lse, options, size, scale, q):
    """The function path's check of a tagged lse, on this rank alone, before the agreement."""
    if getattr(lse, "made_by", None) is None or scale_problem(scale):
        return None
    try:
        options = canonical(options)
    except ValueError:
        return None  # the agreement reports bad options
    return mismatch(lse, made_by(options, size, default_scale(q.shape[-1]) if scale is None else scale))
