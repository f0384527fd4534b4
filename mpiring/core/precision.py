"""Precision: half inputs, what travels on the wire (half or int8 K/V, float32 gradients), what accumulates. No MPI.

- Inputs may be float16 or bfloat16 (``ml_dtypes.bfloat16``: NumPy has none;
  the ``half`` extra installs it, imported only when a bfloat16 is met). Their
  tiles compute in float32; outputs and gradients come back in the input dtype,
  lse in float32.
- ``wire_dtype`` ("float16", "bfloat16", "int8", "float8_e4m3", "float8_e5m2";
  default: the input dtype): K and V are coded once by their owner, before
  they first travel, and decoded by every rank a block reaches, in every mode
  (ring, all-gather, double ring, sparse, Ulysses' all-to-alls, the grid's
  both); under pass-Q (``rotate="q"``) the query blocks, which travel instead.
  The 1-byte wires (``SCALED``) keep a float32 scale per token and head,
  absmax / the code's largest value (int8: 127; FP8, ml_dtypes' float8_e4m3fn
  and float8_e5m2: 448 and 57344), in 4 more bytes at the end of each row, so
  a coded K (or V) is still one array, one message. Per row rather than per
  block: a token with large values coarsens only its own row (FP8's dynamic
  range keeps small values of the row; a block's scale would push the other
  tokens' toward its subnormals), and every mode moves rows, so one form
  serves them all. The owner computes on its own block exactly: its share
  never leaves it.
- ``grad_wire_dtype`` ("float32", "float64"; default float32, float64 for
  float64 inputs): the dK/dV partials that travel (and Ulysses' dq, dK, dV on
  their way back). Every rank sums its own gradients (dq, its block's dK/dV) in
  that dtype or the compute dtype, the wider (``Precision.sums``): float32 for
  float32 and half inputs, as the partials that reach it (docs/backward.md §5).
- ``accumulate`` ("float64", "float32", "input"; default float64): the dtype of
  the running ``(out, lse)`` that every block is merged into ("input": out in
  the input dtype, lse in float32, as GPU libraries that keep per-step outputs).
"""

import numpy as np

__all__ = ["INPUT_DTYPES", "WIRE_DTYPES", "SCALED", "GRAD_WIRE_DTYPES", "ACCUMULATE", "KEYS", "named_dtype",
           "dtype_problem",
           "compute_dtype", "compute_itemsize", "canonical_precision", "row_bytes",
           "Wire", "Plain", "Precision"]

INPUT_DTYPES = ("float16", "bfloat16", "float32", "float64")
WIRE_DTYPES = ("float16", "bfloat16", "int8", "float8_e4m3", "float8_e5m2")
GRAD_WIRE_DTYPES = ("float32", "float64")
ACCUMULATE = ("float64", "float32", "input")
KEYS = ("wire_dtype", "grad_wire_dtype", "accumulate")  # the options of this module, beside the plan's
SCALE_BYTES = 4  # a 1-byte wire row's float32 scale
SCALED = {"int8": 127.0, "float8_e4m3": 448.0, "float8_e5m2": 57344.0}  # per-row scaled wires: their largest code
ML_DTYPES = {"bfloat16": "bfloat16", "float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}  # ml_dtypes' names


def named_dtype(name):
    """The NumPy dtype called ``name``; "bfloat16" and the FP8 wires are ml_dtypes' (``ML_DTYPES``; raises
    ValueError if it is not installed or has not that type)."""
    if name in ML_DTYPES:
        try:
            import ml_dtypes
        except ImportError:
            raise ValueError(f'{name} needs the ml_dtypes package: pip install -e ".[half]"') from None
        found = getattr(ml_dtypes, ML_DTYPES[name], None)
        if found is None:
            raise ValueError(f"{name} needs ml_dtypes.{ML_DTYPES[name]}, which ml_dtypes "
                             f"{getattr(ml_dtypes, '__version__', '?')} lacks: pip install -U ml_dtypes")
        return np.dtype(found)
    return np.dtype(name)


def dtype_problem(name, a):
    """Why the array ``a`` (argument ``name``) has no dtype mpiring computes with, or None."""
    if a.dtype.name not in INPUT_DTYPES or a.dtype.kind not in "fV":
        return f"{name} must be float16, bfloat16, float32 or float64, got {a.dtype}"
    return None


def compute_dtype(dtype):
    """The dtype tiles compute in: float64 for float64 inputs, float32 for float32 and half ones."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


def _choice(name, value, allowed):
    if value is not None and (not isinstance(value, str) or value not in allowed):
        raise ValueError(f"{name} must be None or one of {', '.join(repr(a) for a in allowed)}; got {value!r}")
    return value


def canonical_precision(options):
    """The precision options of ``options`` (missing: defaults), checked; raises ValueError on a bad one."""
    wire = _choice("wire_dtype", options.get("wire_dtype"), WIRE_DTYPES)
    if wire in ML_DTYPES:
        named_dtype(wire)
    grad = _choice("grad_wire_dtype", options.get("grad_wire_dtype"), GRAD_WIRE_DTYPES)
    accumulate = options.get("accumulate", "float64")
    if not isinstance(accumulate, str) or accumulate not in ACCUMULATE:
        raise ValueError(f"accumulate must be one of {', '.join(repr(a) for a in ACCUMULATE)}; got {accumulate!r}")
    return {"wire_dtype": wire, "grad_wire_dtype": grad, "accumulate": accumulate}


def row_bytes(wire_dtype, dim, itemsize):
    """Bytes of one token's ``dim`` values of one head on a K/V wire (what ``Wire.row_bytes`` counts):
    ``dim * itemsize`` when ``wire_dtype`` is None (the input dtype), 2 per value for a half wire, 1 per value
    and the float32 scale's 4 for int8 and FP8."""
    if wire_dtype is None:
        return dim * itemsize
    return dim + SCALE_BYTES if wire_dtype in SCALED else 2 * dim


def compute_itemsize(itemsize):
    """Bytes per element of the dtype tiles compute in, for inputs of ``itemsize``: 8 for float64, else float32's 4.

    Also the default ``grad_wire_dtype``'s: gradients travel in the compute dtype unless told otherwise."""
    return 8 if itemsize == 8 else 4


class Wire:
    """How a K or V block (under pass-Q, a query block) travels: as it is, or coded (half; int8 or FP8 with
    per-row scales) and decoded on arrival.

    ``coded`` is False only when the wire dtype is the input dtype and tiles
    compute in it (float32, float64): then blocks travel in the kernel's own
    form with no copy (``buffers.kernel_form``). Otherwise ``encode`` makes the
    wire form of an array (..., n, d): the wire dtype, or for a ``SCALED`` wire
    (..., n, d + 4) bytes (int8; FP8 codes as uint8) with the row's float32
    scale in its last 4; ``decode`` gives it back in the compute dtype. Every
    mode uses a block the same way: ``own`` is this rank's, never coded;
    ``arrived`` one that travelled, decoded.
    """

    def __init__(self, name, input_dtype):
        self.input = np.dtype(input_dtype)
        self.compute = compute_dtype(self.input)
        self.name = self.input.name if name is None else name
        self.scaled = self.name in SCALED
        self.code = np.dtype(np.int8) if self.name == "int8" else named_dtype(self.name)  # a value's own dtype
        self.dtype = np.dtype(np.uint8) if self.scaled and self.name != "int8" else self.code  # FP8: as bytes
        self.coded = not (self.dtype == self.input == self.compute)

    def row(self, dim):
        """Wire elements of one token's row of ``dim`` values: ``dim``, plus the scale's 4 bytes if scaled."""
        return dim + SCALE_BYTES if self.scaled else dim

    def row_bytes(self, dim):
        """Bytes of one token's row of ``dim`` values on the wire."""
        return self.row(dim) * self.dtype.itemsize

    def encode(self, a, out=None):
        """The wire form of ``a`` (..., n, d) (into ``out`` if given): a itself when not coded."""
        if not self.coded:
            return a
        if out is None:
            out = np.empty(a.shape[:-1] + (self.row(a.shape[-1]),), self.dtype)
        if not self.scaled:
            out[...] = a
            return out
        x = np.asarray(a, np.float32)
        top = SCALED[self.name]
        peak = np.max(np.abs(x), axis=-1, keepdims=True)
        scale = np.where(peak > 0, peak / top, 1).astype(np.float32)  # a row of zeros: any scale, all codes 0
        d = a.shape[-1]
        if self.name == "int8":
            np.rint(x / scale, out=out[..., :d], casting="unsafe")
        else:  # round to nearest even in FP8; the clip keeps a quotient a rounding over the top finite
            out[..., :d] = np.clip(x / scale, -top, top).astype(self.code).view(np.uint8)
        out[..., d:] = scale.view(self.dtype)
        return out

    def decode(self, w, out=None):
        """A wire array back in the compute dtype (..., n, d): ``w`` itself when not coded."""
        if not self.coded:
            return w
        if not self.scaled:
            if out is None:
                return np.asarray(w, self.compute)
            out[...] = w
            return out
        d = w.shape[-1] - SCALE_BYTES
        scale = np.ascontiguousarray(w[..., d:]).view(np.float32)
        if out is None:
            out = np.empty(w.shape[:-1] + (d,), self.compute)
        codes = w[..., :d] if self.name == "int8" else w[..., :d].view(self.code).astype(self.compute)
        np.multiply(codes, scale, out=out, casting="unsafe")
        return out

    def _padded(self, lead, d, n):
        """An empty [x | 1]^T (..., d + 1, n) in the compute dtype, its ones set, and x in it as a (..., n, d) view."""
        out = np.empty(lead + (d + 1, n), self.compute)
        out[..., d, :] = 1
        return out, np.swapaxes(out[..., :d, :], -1, -2)

    def decode_padded(self, w):
        """A wire array as the forward kernel takes a block, [x | 1]^T (..., d + 1, n), in the compute dtype."""
        out, x = self._padded(w.shape[:-2], w.shape[-1] - (SCALE_BYTES if self.scaled else 0), w.shape[-2])
        self.decode(w, x)
        return out

    def own(self, block, padded=False):
        """This rank's own block (its arrays as given) as the kernel takes it, exact: never coded, in the
        compute dtype (``padded``: [x | 1]^T, the forward ring's form)."""
        if not padded:
            return tuple(self.kept(a) for a in block)
        opened = []
        for a in block:
            out, x = self._padded(a.shape[:-2], a.shape[-1], a.shape[-2])
            x[...] = a
            opened.append(out)
        return tuple(opened)

    def arrived(self, block, padded=False):
        """A block that travelled (its arrays in the wire form) as the kernel takes it: decoded (``padded``:
        [x | 1]^T); as it is when not coded."""
        if not self.coded:
            return block
        return tuple(self.decode_padded(w) if padded else self.decode(w) for w in block)

    def kept(self, a):
        """A rank's share of an all-to-all that stays with it (``ulysses.exchange``): exact, in the compute dtype."""
        return np.asarray(a, self.compute)

    def template(self, a):
        """An empty array shaped like the wire form of ``a``: what receive buffers are made from."""
        return np.empty(a.shape[:-1] + (self.row(a.shape[-1]),), self.dtype) if self.coded else a


class Plain:
    """What travels as it is, converted to ``dtype`` (queries, partial results, gradients): the other kind of
    array ``ulysses.exchange`` moves beside a ``Wire``'s, with the same verbs."""

    coded = False

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)

    def row(self, dim):
        return dim

    def encode(self, a):
        return np.asarray(a, self.dtype)

    def decode(self, w):
        return w

    kept = encode  # a rank's own share is converted as if it had travelled


class Precision:
    """The dtypes of one call: input, compute, wire, travelling gradients, running (out, lse)."""

    def __init__(self, input_dtype, wire_dtype=None, grad_wire_dtype=None, accumulate="float64"):
        self.input = np.dtype(input_dtype)
        self.compute = compute_dtype(self.input)
        self.wire = Wire(wire_dtype, self.input)
        self.grad = np.dtype(grad_wire_dtype) if grad_wire_dtype else self.compute  # default: the compute dtype
        self.sums = np.promote_types(self.grad, self.compute)  # each rank's own gradient sums
        self.out = self.input if accumulate == "input" else np.dtype(accumulate)
        self.lse = np.result_type(self.out, self.compute) if accumulate == "input" else self.out
        self.accumulate = accumulate
        self.options = {"wire_dtype": wire_dtype, "grad_wire_dtype": grad_wire_dtype}  # as given (None: default)

    @classmethod
    def of(cls, dtype, options):
        """From a call's (already checked) options dict."""
        return cls(dtype, **{key: options[key] for key in KEYS if key in options})

    def widen(self, a):
        """``a`` in the compute dtype (no copy when it is already)."""
        return np.asarray(a, self.compute)

    def describe(self):
        """A short text of what differs from the defaults, e.g. for a report line."""
        return (f"wire {self.wire.name}, gradients on the wire {self.grad.name}, "
                f"accumulate {self.accumulate}")
