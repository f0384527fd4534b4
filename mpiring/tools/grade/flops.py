"""Counting the multiply-adds of matrix products: an ndarray subclass that keeps a tally.

    with Meter() as meter:
        out = fn(counted(q), counted(k), counted(v))
    meter.macs  # multiply-adds of every matmul / @ / dot / vdot / inner / tensordot / einsum involving them

A ``Counted`` array behaves as an ndarray. Its ``__array_ufunc__`` and ``__array_function__``
unwrap every Counted argument, call NumPy, count the product if the function is one of the
products above, and wrap the array results back as Counted: views, slices, ``astype``, copies,
arithmetic, ``np.where``, ``np.empty_like`` ... of a Counted array are Counted, so the tally
follows the data however the student's code reshapes it; buffers received into are the
student's own (Counted if made with ``np.empty_like``), and objects received pickled come back
Counted (``mark``). Since NumPy only ever sees plain
arrays, a product that calls another one inside (einsum calling tensordot) is counted once.

What is lost: ``np.asarray``, ``np.array``, ``np.ascontiguousarray`` and ``tolist`` return plain
arrays or lists, and other libraries (torch) never see the subclass. A product of two plain
arrays is not counted, so a caller compares the tally with the least the result needs.
"""

import math
import time

import numpy as np

__all__ = ["Counted", "Meter", "counted", "macs_of", "mark"]


class Meter:
    """The tally of multiply-adds made while it is active (``with Meter() as meter:``); one at a time.

    With a ``ledger`` (``mpiring.testing``'s), every product is a "product" event of its timeline
    too, between the communication events: what overlapped what, in order.
    """

    active = None

    def __init__(self, ledger=None):
        self.macs = 0
        self.products = 0  # calls counted
        self.ledger = ledger

    def add(self, macs, start=None):
        self.macs += int(macs)
        self.products += 1
        if self.ledger is not None:
            self.ledger.note("product", start=start, end=time.perf_counter(), macs=int(macs))

    def __enter__(self):
        Meter.active = self
        return self

    def __exit__(self, *exc):
        Meter.active = None


def _plain(x):
    """``x`` with every Counted array in it (lists, tuples, dicts) viewed as a plain ndarray."""
    if isinstance(x, Counted):
        return x.view(np.ndarray)
    if isinstance(x, (list, tuple)):
        return type(x)(_plain(y) for y in x)
    if isinstance(x, dict):
        return {key: _plain(y) for key, y in x.items()}
    return x


def _wrap(x):
    """``x`` with every plain ndarray in it (tuples, lists) viewed as Counted."""
    if type(x) is np.ndarray:
        return x.view(Counted)
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_wrap(y) for y in x)
    return x


def _einsum_macs(subscripts, operands):
    """The naive loop count of an einsum of two or more arrays: the product of every index's extent."""
    if not isinstance(subscripts, str) or len(operands) < 2:
        return 0  # one operand (a transpose, a trace, a sum) or the interleaved form: not a product counted
    extent = {}
    for spec, operand in zip(subscripts.replace(" ", "").split("->")[0].split(","), operands):
        shape = np.shape(operand)
        head, _, tail = spec.partition("...")
        broadcast = len(shape) - len(head) - len(tail)  # axes under "...", numbered from the right
        letters = list(head) + [("...", broadcast - i) for i in range(broadcast)] + list(tail)
        for letter, n in zip(letters, shape):
            extent[letter] = max(extent.get(letter, 1), n)
    return math.prod(extent.values())


def macs_of(func, args, kwargs, result):
    """Multiply-adds of one call of a NumPy product (0 for anything else); ``args`` are plain arrays."""
    if func in (np.matmul, np.dot, np.inner):
        a = np.asarray(args[0])
        if a.ndim == 0 or np.ndim(args[1]) == 0:
            return 0  # a scalar times an array: a scaling, not a product
        return np.size(result) * a.shape[-1]
    if func is np.vdot:
        return np.size(args[0])
    if func is np.tensordot:
        axes = args[2] if len(args) > 2 else kwargs.get("axes", 2)
        a = np.asarray(args[0])
        summed = a.shape[a.ndim - axes:] if isinstance(axes, int) else [a.shape[i] for i in np.atleast_1d(axes[0])]
        return np.size(result) * math.prod(summed)
    if func is np.einsum:
        return _einsum_macs(args[0], args[1:])
    return 0


class Counted(np.ndarray):
    """An ndarray whose matrix products are tallied on the active Meter, and whose results stay Counted."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        args = _plain(inputs)
        if out is not None:
            kwargs["out"] = _plain(out)
        start = time.perf_counter()
        result = getattr(ufunc, method)(*args, **kwargs)
        if ufunc is np.matmul and method == "__call__" and Meter.active is not None:
            Meter.active.add(macs_of(np.matmul, args, kwargs, result), start)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        args, plain_kwargs = _plain(args), _plain(kwargs)
        start = time.perf_counter()
        result = func(*args, **plain_kwargs)
        if Meter.active is not None:
            macs = macs_of(func, args, plain_kwargs, result)
            if macs:
                Meter.active.add(macs, start)
        if kwargs.get("out") is not None:
            return kwargs["out"]
        return _wrap(result)

    def dot(self, b, out=None):
        return np.dot(self, b, out=out)


def counted(a):
    """``a`` (an ndarray) as a Counted view of the same memory."""
    return np.asarray(a).view(Counted)


def mark(obj):
    """A received object: a plain ndarray comes back Counted while a Meter is active (pickled messages)."""
    if Meter.active is not None and type(obj) is np.ndarray:
        return obj.view(Counted)
    return obj
