"""The sequence axis of a call's arrays, checked against everything the call knows. No MPI.

``seq_axis`` is an int (-2: ``(..., S, D)``; -3: ``(B, S, H, D)``) or a string
naming every axis, ``s`` the sequence and ``d`` the head dim last: "bshd"
(flash-attn's ``(B, S, H, D)``), "bhsd" (torch SDPA's and transformers'
``(B, H, S, D)``). An int cannot tell heads from tokens when both axes have the
same length: such a call is refused unless a string says which is which.
"""

import numpy as np

from .checks import local_problem

__all__ = ["seq_index", "axis_problem", "FORMATS"]

FORMATS = {"bshd": "(B, S, H, D), as flash-attn", "bhsd": "(B, H, S, D), as torch SDPA and transformers"}


def seq_index(seq_axis, ndim):
    """The sequence axis of an ``ndim``-axis array as a negative int (``seq_axis`` already checked)."""
    if isinstance(seq_axis, str):
        return seq_axis.index("s") - len(seq_axis)
    return int(seq_axis) - ndim if seq_axis >= 0 else int(seq_axis)


def _spelling_problem(seq_axis):
    if isinstance(seq_axis, str):
        if (seq_axis.count("s") != 1 or not seq_axis.endswith("d") or len(set(seq_axis)) != len(seq_axis)
                or not seq_axis.isalpha()):
            return (f"seq_axis must be an int or a string naming every axis, 's' the sequence and 'd' the head dim "
                    f"last (e.g. 'bshd', 'bhsd'); got {seq_axis!r}")
        return None
    if isinstance(seq_axis, (bool, np.bool_)) or not isinstance(seq_axis, (int, np.integer)):
        return f"seq_axis must be an int or a string such as 'bshd' or 'bhsd', got {seq_axis!r}"
    return None


def _named(axis, ndim):
    """Axis ``axis`` (negative) of ``ndim``-axis arrays as seq_axis, with its string for 4 axes."""
    names = {-3: "bshd", -2: "bhsd"} if ndim == 4 else {}
    return f"seq_axis={axis}" + (f" ('{names[axis]}': {FORMATS[names[axis]]})" if axis in names else "")


def _shapes(arrays):
    return ", ".join(f"{name} {a.shape}" for name, a in arrays.items())


def _fits(arrays, axis, tokens, same_rows, lse):
    """Why the arrays do not read with ``axis`` as the sequence, or None."""
    moved = {name: np.moveaxis(a, axis, -2) for name, a in arrays.items()}
    q, k, v = moved["q"], moved["k"], moved["v"]
    problem = local_problem(q, k, v, None, same_rows=same_rows)
    if problem is None and tokens is not None:
        for name, a in (("q", q), ("k", k)):
            if a.shape[-2] != tokens[name]:
                return f"{name} would hold {a.shape[-2]} tokens, but this rank holds {tokens[name]}"
    if problem is None:
        for name in ("dout", "out"):
            if name in moved and moved[name].shape[:-1] != q.shape[:-1]:
                return f"{name} would not have q's rows"
        if isinstance(lse, np.ndarray) and lse.shape != q.shape[:-1]:
            return f"lse {lse.shape} is not q's (..., heads, tokens) {q.shape[:-1]}"
    return problem


def axis_problem(arrays, seq_axis, tokens=None, same_rows=True, lse=None):
    """Why ``seq_axis`` is not the sequence axis of ``arrays`` (q, k, v, maybe dout, out), or None.

    ``tokens``: this rank's query and key counts when known (a ``Ring``), as
    ``{"q": n, "k": m}``; ``lse`` the backward's (``(..., H, S)`` whatever the
    axis). The message names the axis and the shapes, and the axis that would
    fit when one does. An int axis other than the default -2 (the native
    ``(..., H, S, D)``) whose arrays hold as many heads as tokens is refused:
    it cannot be told from the heads axis (a string can). The default is taken
    at its word, as documented.
    """
    problem = _spelling_problem(seq_axis)
    if problem:
        return problem
    for name, a in arrays.items():
        if not isinstance(a, np.ndarray):
            return f"{name} must be a NumPy array, got {type(a).__name__}"
        if a.ndim < 2:  # as the array checks say it
            return f"{name} must have shape (..., seq, dim), got {a.shape}"
        if isinstance(seq_axis, str) and len(seq_axis) != a.ndim:
            return f"seq_axis={seq_axis!r} names {len(seq_axis)} axes, but {name} has {a.ndim}: {a.shape}"
        if not isinstance(seq_axis, str) and (not -a.ndim <= seq_axis < a.ndim - 1 or seq_axis == -1):
            return f"seq_axis={seq_axis} is not an axis of {name} {a.shape} other than its last (the head dim)"
    ndims = {a.ndim for a in arrays.values()}
    if len(ndims) != 1 or min(ndims) < 3:
        return None  # the array checks say what is wrong; with (S, D) arrays there is no other axis
    ndim = ndims.pop()
    axis = seq_index(seq_axis, ndim)

    def others():
        return [a for a in range(-ndim, -1) if a != axis and _fits(arrays, a, tokens, same_rows, lse) is None]

    why = _fits(arrays, axis, tokens, same_rows, lse)
    if why is not None:
        fit = others()
        if not fit:
            return None  # no reading fits: the array checks name the problem
        return (f"seq_axis={seq_axis!r} does not fit the arrays (read so, {why}); {_named(fit[0], ndim)} "
                f"does: {_shapes(arrays)}")
    swapped = {-3: -2, -2: -3}.get(axis)
    if (isinstance(seq_axis, str) or axis == -2 or ndim < 4 or arrays["q"].shape[axis] == 1
            or any(a.shape[axis] != a.shape[swapped] for a in arrays.values()) or swapped not in others()):
        return None
    return (f"seq_axis={seq_axis} cannot be told from the heads axis: axes -3 and -2 have the same length in "
            f"{_shapes(arrays)}, so heads would be taken for tokens if the arrays are the other way round; name the "
            f"layout: seq_axis='bshd' {FORMATS['bshd']}, or 'bhsd' {FORMATS['bhsd']}")
