"""What a user's function or data is, by content: a digest of everything it can read, and where two differ. No MPI.

A mask, bias or score function runs on every rank and must be the same
everywhere; its address differs from rank to rank and its ``repr`` hides data
(NumPy elides long arrays, torch prints 1000 entries at most). ``content(obj)``
walks what ``obj`` can read and digests it leaf by leaf:

- a function: its code (nested code objects too), closure cells, defaults,
  keyword defaults, attributes, and the module globals its code names,
  recursively; a function of a library (the standard library, an installed
  package, mpiring) by its name, its closure cells and defaults;
- ``functools.partial``: its function, arguments and keywords; a bound method:
  its function and ``__self__``;
- any other object: its class (a class of the user's with its methods) and its
  state (``__dict__`` and slots, or what pickle would save of it);
- NumPy arrays and torch tensors by dtype, shape and bytes; numbers and strings
  by value; containers item by item (sets and dicts in a fixed order).

Each leaf has a path (``closure cell 'flags'``, ``global 'table'[2]``). Two
contents are equal when their digests are; ``difference`` names the first leaf
that differs and, given both ranks' values of it, the first differing element.
What has no content to read (a lock, an open file, a generator, the MPI
module or a communicator: the rank itself) raises ``Unreadable``, a ValueError.
"""

import enum
import functools
import hashlib
import sys
import types
from pathlib import Path
from typing import NamedTuple

import numpy as np

__all__ = ["content", "Content", "Leaf", "Unreadable", "first_difference", "difference", "leaf_value", "described"]

MAX_DEPTH = 100  # nesting beyond this is refused (a cycle is not: it is seen once, then named)
SENT_WHOLE = 1 << 20  # an array of up to this many entries travels whole to name its first differing element
CHUNKS = 1024  # a larger one as this many chunk digests: the message names the first differing chunk


class Unreadable(ValueError):
    """An object whose content cannot be compared across processes."""


class Leaf(NamedTuple):
    """One part of a content: where it is, what it is (type, dtype, shape) and a digest of its value."""

    path: str
    what: str
    digest: str


class Content:
    """The leaves of an object and their digest; the leaves' values stay on this rank (not pickled)."""

    def __init__(self, leaves, values):
        self.leaves, self.values = leaves, values
        self.digest = hashlib.sha1("\n".join(f"{p}\0{w}\0{d}" for p, w, d in leaves).encode()).hexdigest()[:16]

    def __reduce__(self):
        return _rebuilt, (self.leaves, self.digest)

    def __eq__(self, other):
        return isinstance(other, Content) and other.digest == self.digest

    def __hash__(self):
        return hash(self.digest)

    def __repr__(self):
        return f"Content({self.digest}, {len(self.leaves)} leaves)"


def _rebuilt(leaves, digest):
    made = Content.__new__(Content)
    made.leaves, made.values, made.digest = leaves, {}, digest
    return made


def content(obj, name="value", parts=None):
    """The ``Content`` of ``obj``; paths start with ``name``. Raises ``Unreadable`` naming the part it cannot read.

    ``parts``: labels of ``obj``'s items (a sequence), for paths such as ``mask Function(f).fn`` rather than
    ``mask[0].fn``."""
    walk = _Walk()
    if parts is None:
        walk.visit(obj, name, 0)
    else:
        walk.leaf(name, f"{len(parts)} parts", b"")
        for label, item in zip(parts, obj):
            walk.visit(item, f"{name} {label}", 1)
    return Content(walk.leaves, walk.values)


@functools.cache
def _library(module):
    """Whether functions and classes of ``module`` are library code (the same on every rank): taken by name."""
    top = (module or "").split(".")[0]
    if top in sys.stdlib_module_names or top in ("builtins", "mpiring"):
        return True
    file = getattr(sys.modules.get(top), "__file__", None)
    return file is not None and any(p in ("site-packages", "dist-packages") for p in Path(file).parts)


def _const(c):
    """A code constant as bytes that do not depend on the process (frozensets sorted: string hashes are seeded)."""
    if isinstance(c, types.CodeType):
        return _code(c)
    if isinstance(c, (tuple, frozenset)):
        items = [_const(x) for x in c]
        return type(c).__name__.encode() + b"(" + b",".join(sorted(items) if isinstance(c, frozenset) else items) + b")"
    return repr((type(c).__name__, c)).encode()


def _code(code):
    head = (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, code.co_argcount,
            code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
    return code.co_code + repr(head).encode() + b"".join(_const(c) for c in code.co_consts)


def _names(code):
    """The global names a code object and the code nested in it may read."""
    found = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            found |= _names(c)
    return found


def _order(key):
    """A sort key for dict keys and set items that does not depend on the process (no hash order)."""
    return (type(key).__name__, repr(key)) if isinstance(key, (str, int, float, bytes, bool, type(None))) \
        else (type(key).__name__, content(key).digest)


_NONE = object()  # a leaf without a value to show (code, containers)
_SCALARS = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented), range, slice)


class _Walk:
    def __init__(self):
        self.leaves, self.values, self.seen, self.kept = [], {}, {}, []

    def leaf(self, path, what, data, value=_NONE):
        self.leaves.append(Leaf(path, what, hashlib.sha1(data).hexdigest()[:16]))
        if value is not _NONE:
            self.values[len(self.leaves) - 1] = value

    def visit(self, obj, path, depth):
        if depth > MAX_DEPTH:
            raise Unreadable(f"{path} is nested more than {MAX_DEPTH} levels deep")
        if isinstance(obj, _SCALARS):
            return self.leaf(path, type(obj).__name__, repr(obj).encode(), obj)
        if id(obj) in self.seen:  # a cycle, or one object read twice: named by where it was first seen
            return self.leaf(path, f"the same object as {self.seen[id(obj)]}", b"")
        self.seen[id(obj)] = path
        self.kept.append(obj)  # alive until the walk ends: ids are not reused
        for kind, method in _KINDS:
            if kind(obj):
                return method(self, obj, path, depth + 1)
        return self.instance(obj, path, depth + 1)

    def array(self, a, path, depth):
        if a.dtype.hasobject:
            return self.items(a.tolist(), f"{path} (numpy object array {a.shape})", depth, "numpy object array")
        a = np.ascontiguousarray(a)
        what = f"numpy.ndarray {a.dtype} {a.shape}"
        self.leaf(path, what, a.dtype.str.encode() + repr(a.shape).encode() + a.view(np.uint8).data, a)

    def tensor(self, t, path, depth):
        torch = sys.modules["torch"]
        if t.layout != torch.strided:
            t = t.to_dense()
        if t.device.type == "meta" or t.is_quantized:
            raise Unreadable(f"{path} is a {t.device.type if t.device.type == 'meta' else 'quantized'} tensor, "
                             f"whose values cannot be compared")
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        self.leaf(path, f"torch.Tensor {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}",
                  str(t.dtype).encode() + repr(tuple(t.shape)).encode() + raw.data, t)

    def named(self, obj, path, depth):  # dtypes, devices, numpy scalars, enum members: by type and value
        self.leaf(path, type(obj).__qualname__, repr(obj).encode(), obj)

    def module(self, m, path, depth):
        if m.__name__.split(".")[0] == "mpi4py":
            raise Unreadable(_RANK.format(path=path, what=f"the module {m.__name__}"))
        self.leaf(path, "module", m.__name__.encode())

    def items(self, items, path, depth, kind=None):
        items = list(items)
        self.leaf(path, f"{kind or type(items).__name__} of {len(items)}", b"")
        for i, x in enumerate(items):
            self.visit(x, f"{path}[{i}]", depth)

    def sequence(self, s, path, depth):
        self.items(s, path, depth, type(s).__qualname__)

    def unordered(self, s, path, depth):
        self.items(sorted(s, key=_order), path, depth, type(s).__qualname__)

    def mapping(self, d, path, depth):
        keys = sorted(d, key=_order)
        self.leaf(path, f"{type(d).__qualname__} of {len(keys)}", b"")
        for key in keys:
            where = f"{path}[{key!r:.40}]"
            if not isinstance(key, (str, int)):
                self.visit(key, f"{where} (its key)", depth)
            self.visit(d[key], where, depth)

    def function(self, fn, path, depth):
        code, library = fn.__code__, _library(fn.__module__)
        name = f"{fn.__module__}.{fn.__qualname__}" if library else fn.__qualname__
        self.leaf(path, f"function {name}", name.encode() if library else _code(code))
        for var, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                self.leaf(f"{path}: closure cell '{var}'", "empty cell", b"")
                continue
            self.visit(value, f"{path}: closure cell '{var}'", depth)
        defaults = fn.__defaults__ or ()
        for var, value in zip(code.co_varnames[code.co_argcount - len(defaults):code.co_argcount], defaults):
            self.visit(value, f"{path}: default '{var}'", depth)
        for var, value in sorted((fn.__kwdefaults__ or {}).items()):
            self.visit(value, f"{path}: keyword default '{var}'", depth)
        for var, value in sorted(vars(fn).items()):
            self.visit(value, f"{path}: attribute '{var}'", depth)
        if not library:
            for var in sorted(_names(code) & fn.__globals__.keys()):
                self.visit(fn.__globals__[var], f"{path}: global '{var}'", depth)

    def partial(self, p, path, depth):
        self.leaf(path, type(p).__qualname__, b"")
        self.visit(p.func, f"{path}: its function", depth)
        for i, a in enumerate(p.args):
            self.visit(a, f"{path}: argument {i}", depth)
        for var, value in sorted(p.keywords.items()):
            self.visit(value, f"{path}: keyword '{var}'", depth)

    def method(self, m, path, depth):
        self.visit(m.__func__, path, depth)
        self.visit(m.__self__, f"{path}: its object", depth)

    def builtin(self, fn, path, depth):  # C functions and methods: by name, and the object a method is bound to
        owner = getattr(fn, "__self__", None)
        own = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", type(fn).__qualname__)  # ufuncs: __name__
        name = f"{getattr(fn, '__module__', None) or type(owner).__qualname__}.{own}"
        self.leaf(path, f"builtin {name}", name.encode())
        if owner is not None and not isinstance(owner, types.ModuleType):
            self.visit(owner, f"{path}: its object", depth)

    def cls(self, c, path, depth):
        name = f"{c.__module__}.{c.__qualname__}"
        self.leaf(path, "class", name.encode())
        if c.__module__.split(".")[0] == "mpi4py":
            raise Unreadable(_RANK.format(path=path, what=f"the class {name}"))
        if _library(c.__module__):
            return
        for base in c.__mro__[1:]:
            if not _library(base.__module__):
                self.visit(base, f"{path}: base {base.__qualname__}", depth)
        for var, value in sorted(vars(c).items()):
            if var not in ("__dict__", "__weakref__", "__doc__", "__module__", "__qualname__"):
                self.visit(value, f"{path}.{var}", depth)

    def wrapper(self, w, path, depth):  # staticmethod, classmethod, property: the functions inside
        self.leaf(path, type(w).__qualname__, b"")
        for var in ("__func__", "fget", "fset", "fdel"):
            if getattr(w, var, None) is not None:
                self.visit(getattr(w, var), f"{path}.{var}", depth)

    def instance(self, obj, path, depth):
        kind = type(obj)
        if kind.__module__.split(".")[0] == "mpi4py":
            raise Unreadable(_RANK.format(path=path, what=f"an {kind.__qualname__}"))
        self.visit(kind, f"{path} (its class)", depth)
        if not _library(kind.__module__) and (hasattr(obj, "__dict__") or _slots(kind)):
            state = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
            state.update({s: getattr(obj, s) for s in _slots(kind) if hasattr(obj, s)})
            for var, value in sorted(state.items()):
                self.visit(value, f"{path}.{var}", depth)
            return
        try:
            saved = obj.__reduce_ex__(4)
        except Exception as exc:  # noqa: BLE001 (whatever pickle says: this object has no content to read)
            raise Unreadable(f"{path} is {_a(kind)} whose content mpiring cannot read ({type(exc).__name__}: "
                             f"{exc}); pass the data it holds as arrays, numbers or strings instead") from None
        if isinstance(saved, str):  # a global of its module: by name
            return self.leaf(f"{path} (saved as)", "name", saved.encode())
        args, state, *rest = tuple(saved[1:]) + (None,) * 4
        if args and not (len(args) == 1 and args[0] is kind):
            self.visit(args, f"{path} (arguments)", depth)
        if isinstance(state, dict) and all(isinstance(var, str) for var in state):
            for var, value in sorted(state.items()):
                self.visit(value, f"{path}.{var}", depth)
        elif state is not None:
            self.visit(state, f"{path} (state)", depth)
        for what, part in zip(("items", "entries"), rest[:2]):
            if part is not None:
                self.visit(list(part), f"{path} ({what})", depth)


_RANK = ("{path} reads {what}: a mask, bias or score function must compute the same on every rank, and mpiring "
         "cannot compare what depends on the process; compute rank-dependent data outside the function")


def _a(kind):
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    return f"an {name}" if name[0] in "aeiou" else f"a {name}"


def _slots(kind):
    return [s for c in kind.__mro__ for s in getattr(c, "__slots__", ()) if s not in ("__dict__", "__weakref__")]


def _is_tensor(obj):
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _is_named(obj):
    torch = sys.modules.get("torch")
    plain = (np.dtype, np.generic, enum.Enum)
    return isinstance(obj, plain) or (torch is not None and isinstance(obj, (torch.dtype, torch.device)))


_KINDS = (  # the first that fits
    (lambda o: isinstance(o, np.ndarray), _Walk.array),
    (_is_tensor, _Walk.tensor),
    (_is_named, _Walk.named),
    (lambda o: isinstance(o, types.ModuleType), _Walk.module),
    (lambda o: isinstance(o, (list, tuple)), _Walk.sequence),
    (lambda o: isinstance(o, (set, frozenset)), _Walk.unordered),
    (lambda o: isinstance(o, (dict, types.MappingProxyType)), _Walk.mapping),
    (lambda o: isinstance(o, types.FunctionType), _Walk.function),
    (lambda o: isinstance(o, functools.partial), _Walk.partial),
    (lambda o: isinstance(o, types.MethodType), _Walk.method),
    (lambda o: isinstance(o, (types.BuiltinFunctionType, types.BuiltinMethodType, types.MethodWrapperType,
                              types.WrapperDescriptorType, types.MethodDescriptorType, np.ufunc)), _Walk.builtin),
    (lambda o: isinstance(o, type), _Walk.cls),
    (lambda o: isinstance(o, (staticmethod, classmethod, property)), _Walk.wrapper),
)


# ---------------------------------------------------------------- naming what differs


def leaf_value(found, index):
    """What to send of this rank's leaf ``index`` to name a difference: small values whole, a large array as
    ``CHUNKS`` chunk digests; None when the leaf has no value (code: its digest says it all)."""
    if index not in found.values:
        return None
    value = found.values[index]
    if _is_tensor(value):
        torch = sys.modules["torch"]
        value = value.float() if value.dtype in (torch.bfloat16, torch.float16) else value
        value = value.reshape(-1).numpy() if value.dtype != torch.bool else value.reshape(-1).numpy().copy()
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        if flat.size <= SENT_WHOLE:
            return ("whole", flat.copy(), value.shape)
        edges = np.linspace(0, flat.size, CHUNKS + 1).astype(np.int64)
        return ("chunks", edges, [hashlib.sha1(flat[a:b].tobytes()).hexdigest() for a, b in zip(edges, edges[1:])])
    return ("value", repr(value))


def first_difference(mine, ref):
    """The index of the first leaf where ``Content`` ``mine`` differs from ``ref`` (None: equal)."""
    if mine.digest == ref.digest:
        return None
    pairs = zip(mine.leaves, ref.leaves)
    return next((i for i, (x, y) in enumerate(pairs) if x != y), min(len(mine.leaves), len(ref.leaves)))


def difference(index, leaves, values, ranks):
    """What differs between two ranks' contents at leaf ``index`` (``first_difference``): both ``leaves``
    (None past a content's end), their ``values`` (``leaf_value``) and ``ranks``: (this one, the reference)."""
    (a, b), (ra, rb) = leaves, ranks
    if a is None or b is None:
        longer, shorter = (ra, rb) if b is None else (rb, ra)
        extra = (a or b)
        return f"rank {longer} has more parts than rank {shorter}, the first {extra.path} ({extra.what})"
    if a.path != b.path:
        return f"rank {rb} has {b.path} ({b.what}) where rank {ra} has {a.path} ({a.what})"
    if a.what != b.what:
        return f"{a.path}: rank {rb} has {b.what}, rank {ra} has {a.what}"
    va, vb = values
    where = f"{a.path} ({a.what})"
    if a.what.startswith("function"):
        return f"{where}: the code differs"
    if va is None or vb is None:
        return f"{where} differs"
    if va[0] == "value":
        return f"{where}: rank {rb} has {vb[1]}, rank {ra} has {va[1]}"
    if va[0] == "chunks":
        i = next(i for i, (x, y) in enumerate(zip(va[2], vb[2])) if x != y)
        return f"{where}: first difference among elements {va[1][i]}..{va[1][i + 1] - 1}"
    x, y = va[1], vb[1]
    same = (x.view(np.uint8).reshape(x.size, -1) == y.view(np.uint8).reshape(y.size, -1)).all(axis=1)
    i = int(np.argmin(same))
    at = tuple(int(j) for j in np.unravel_index(i, va[2])) if len(va[2]) > 1 else i
    return f"{where}: first differing element {at}: rank {rb} has {y[i].item()!r}, rank {ra} has {x[i].item()!r}"


def described(value):
    """``value`` in a few words for a message, without addresses (which differ from rank to rank)."""
    if isinstance(value, np.ndarray):
        items = value.reshape(-1).tolist()
        return str(items) if len(items) <= 8 else f"[{', '.join(map(str, items[:4]))}, ..., {items[-1]}] " \
            f"({len(items)} entries)"
    if isinstance(value, tuple):
        return "(" + ", ".join(described(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, functools.partial):
        return f"functools.partial({described(value.func)}, ...)"
    if isinstance(value, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return value.__qualname__
    text = repr(value)
    return f"{type(value).__qualname__} object" if " at 0x" in text else text
