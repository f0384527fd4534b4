"""The spec: what a call computes and how its blocks move, in one immutable, validated object. No MPI.

    spec = Spec.of(seq_len=4096, causal=True, layout="zigzag", mode="ring")
    spec.strategy        # "ring": the key of the strategy table (mpiring.parallel.strategies)
    spec.plan(4)         # the plan of 4 ranks (plans.make.make_plan)
    spec.digest          # 16 hex digits: equal specs, equal digests

Every entry point (the ``Ring`` handle, ``ring_attention`` and its backward,
``distributed_attention``, the CLI, ``simulate``) builds one from the keyword
arguments people pass, or takes one as ``spec=``; the agreement compares the
ranks' specs field by field (``shown``) and gathers their positions
(``with_ranks``), and the lse a forward returns carries the spec's summary
(``made_by``), which the backward compares with its own.

The problem: which tokens each rank holds (``seq_len`` and ``layout``, or
``positions`` / ``kv_positions``), the mask (``causal``, ``window``,
``cu_seqlens``, ``causal_block``, and ``mask``: more pieces of any kind,
``plans.visibility.MaskPiece``), the softmax ``scale``, the score modifiers
(``softcap``, ``bias``, ``score_mod`` with ``score_mod_grad``, ``sinks``,
``dropout`` keyed by ``seed``, and ``return_max_logit``; docs/masks.md) and the precision
options (``wire_dtype``, ``grad_wire_dtype``, ``accumulate``). The strategy:
``mode`` (ring, bidirectional, allgather, ulysses, double_ring, sparse), ``rotate``
(pass-Q), ``ulysses_size`` (the ring x Ulysses grid) and ``node_size`` (the
double ring's nodes). How a call runs (timeout, threads, the sequence axis)
is not part of what it computes and stays with the call.
"""

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

import numpy as np

from ..core.modifiers import TableBias, mod_values, tile_indices
from ..core.precision import canonical_precision
from .content import content
from .heads import heads_problem
from .layouts import check_layout, sort_order
from .make import make_plan
from .plan import ALL_MODES, MODES
from .visibility import MaskPiece, check_causal_block, check_mask, check_window

__all__ = ["Spec", "ROTATE", "FIELDS", "SCORE_FIELDS", "spec_problem", "digest", "is_real", "scale_problem", "count",
           "integers"]

ROTATE = ("kv", "q", "auto")
ROW_OPTIONS = ("positions", "kv_positions")  # this rank's own: gathered from every rank, not compared
PRECISION = ("wire_dtype", "grad_wire_dtype", "accumulate")
SCORE_FIELDS = ("softcap", "bias", "score_mod", "score_mod_grad", "sinks", "dropout", "seed",
                "return_max_logit")  # the score modifiers
FUNCTIONS = ("mask", "bias", "score_mod", "score_mod_grad")  # the user's functions: agreed by what they read


def count(name, value, what=""):
    """``value`` as an int, None kept; ValueError unless a positive integer."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer{what} or None, got {value!r}")
    return int(value)


def integers(name, values, what=" of global positions"):
    """``values`` as int64 (or None); ValueError unless a 1-D integer array."""
    if values is None:
        return None
    p = np.asarray(values)
    if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer):
        raise ValueError(f"{name} must be a 1-D integer array{what}, got {p.dtype} of shape {p.shape}")
    return p.astype(np.int64)


def is_real(x):
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


def scale_problem(scale):
    """Why ``scale`` is not a valid softmax scale, or None (None means the default)."""
    if scale is not None and not (is_real(scale) and np.isfinite(scale) and scale > 0):
        return f"scale must be a finite positive number, got {scale!r}"
    return None


def _scores(given):
    """The score options, checked: ValueError naming the first bad one."""
    softcap, bias, sinks, dropout, seed = (given[n] for n in ("softcap", "bias", "sinks", "dropout", "seed"))
    if softcap is not None and not (is_real(softcap) and np.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be a finite positive number (logits become c * tanh(logits / c)), "
                         f"got {softcap!r}")
    if bias is not None and not callable(bias):
        raise ValueError(f"bias must be a function bias(heads, q_pos, k_pos) -> array, got {bias!r}")
    for name in ("score_mod", "score_mod_grad"):
        if given[name] is not None and not callable(given[name]):
            raise ValueError(f"{name} must be a function {name}(score, batch, head, q_pos, k_pos) -> array, got "
                             f"{given[name]!r}")
    if given["score_mod_grad"] is not None and given["score_mod"] is None:
        raise ValueError("score_mod_grad is the derivative of a score_mod: give the score_mod too")
    if sinks is not None:
        sinks = np.asarray(sinks)
        if sinks.ndim != 1 or sinks.dtype.kind not in "fiu" or not np.all(np.isfinite(sinks)):
            raise ValueError(f"sinks must be a 1-D array of finite logits, one per query head; got "
                             f"{sinks.dtype} of shape {sinks.shape}")
        sinks = sinks.astype(np.float64)
    if not (is_real(dropout) and 0 <= dropout < 1):
        raise ValueError(f"dropout must be a probability 0 <= p < 1, got {dropout!r}")
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
        raise ValueError(f"seed must be an integer (dropout's generator key), got {seed!r}")
    if not isinstance(given["return_max_logit"], (bool, np.bool_)):
        raise ValueError(f"return_max_logit must be True or False, got {given['return_max_logit']!r}")
    return dict(softcap=None if softcap is None else float(softcap), bias=bias, sinks=sinks,
                score_mod=given["score_mod"], score_mod_grad=given["score_mod_grad"],
                dropout=float(dropout), seed=int(seed), return_max_logit=bool(given["return_max_logit"]))


def _rotate_problem(rotate, mode):
    if not isinstance(rotate, str) or rotate not in ROTATE:
        return f"rotate must be one of {', '.join(ROTATE)}; got {rotate!r}"
    if rotate == "q" and mode != "ring":
        why = {"ulysses": "Ulysses moves heads by all-to-all, not blocks round a ring: there is nothing to rotate"}
        return (f"rotate='q' passes the queries one way round the ring: it needs mode='ring' (also across "
                f"ulysses_size groups), got mode={mode!r}; "
                + why.get(mode, "that movement has no pass-Q form (not built)"))
    return None


@dataclass(frozen=True, eq=False)
class Spec:
    """What a call computes (the problem) and how its blocks move (the strategy). Build it with ``Spec.of``."""

    seq_len: int | None = None  # tokens (keys) of the whole sequence; None: the ranks' shards add up to it
    layout: str = "contiguous"
    positions: object = None  # this rank's query positions (int64), or once agreed every rank's (a list)
    kv_positions: object = None  # ... of its key/value rows when they are not the queries'
    causal: bool = False
    window: tuple = (-1, -1)
    cu_seqlens: np.ndarray | None = None
    causal_block: int | None = None
    mask: tuple = ()  # more mask pieces (plans.visibility.MaskPiece), all of which must allow a key
    scale: float | None = None  # None: 1/sqrt(head dim)
    wire_dtype: str | None = None
    grad_wire_dtype: str | None = None
    accumulate: str = "float64"
    mode: str = "ring"
    rotate: str = "kv"
    ulysses_size: int | None = None
    node_size: int | None = None
    softcap: float | None = None  # logits become softcap * tanh(logits / softcap)
    bias: object = None  # fn(heads, q_pos, k_pos) -> additive bias broadcastable to (heads, queries, keys)
    score_mod: object = None  # fn(score, batch, head, q_pos, k_pos) -> the score (core.modifiers), after the bias
    score_mod_grad: object = None  # its derivative d score_mod / d score, same arguments (needed by a backward)
    sinks: np.ndarray | None = None  # one logit per query head, added once to each row's softmax denominator
    dropout: float = 0.0  # probability of dropping an attention weight (core.scores.dropout_keep, keyed by seed)
    seed: int = 0
    return_max_logit: bool = False  # the forward also returns the largest visible scale * q.k per batch and head

    @classmethod
    def of(cls, **keywords):
        """The spec of these keyword arguments (those of ``ring_attention``), checked on this rank alone.

        Raises ValueError naming the first bad argument; checks that need every
        rank (positions that partition the sequence, cu_seqlens against its
        length, heads against the ranks) come with the plan (``plan``).
        """
        unknown = set(keywords) - set(FIELDS)
        if unknown:
            raise TypeError(f"unknown spec options {sorted(unknown)}; the options are {', '.join(FIELDS)}")
        given = {name: keywords.get(name, field.default) for name, field in FIELDS.items()}
        check_layout(given["layout"])
        mode = given["mode"]
        if not isinstance(mode, str) or mode not in ALL_MODES:
            raise ValueError(f"mode must be one of {', '.join(ALL_MODES)}; got {mode!r}")
        cu = given["cu_seqlens"]
        if cu is not None:
            cu = np.asarray(cu)
            if cu.ndim != 1 or not np.issubdtype(cu.dtype, np.integer):
                raise ValueError(f"cu_seqlens must be a 1-D integer array [0, ..., seq_len], got {cu!r}")
            cu = cu.astype(np.int64)
        if not isinstance(given["causal"], (bool, np.bool_)):
            raise ValueError(f"causal must be True or False, got {given['causal']!r}")
        rows = {name: integers(name, given[name]) for name in ROW_OPTIONS}
        if rows["kv_positions"] is not None and rows["positions"] is None:
            raise ValueError("kv_positions needs positions: the query rows' own positions")
        seq_len = given["seq_len"]
        if seq_len is not None and (isinstance(seq_len, (bool, np.bool_))
                                    or not isinstance(seq_len, (int, np.integer))):
            raise ValueError(f"seq_len must be the number of tokens of the whole sequence (an int), got {seq_len!r}")
        scale = given["scale"]
        problem = scale_problem(scale) or _rotate_problem(given["rotate"], mode)
        if problem:
            raise ValueError(problem)
        scores = _scores(given)
        spec = cls(seq_len=None if seq_len is None else int(seq_len), layout=given["layout"], **rows, **scores,
                   causal=bool(given["causal"]), window=check_window(given["window"]), cu_seqlens=cu,
                   causal_block=check_causal_block(given["causal_block"], given["causal"]),
                   mask=check_mask(given["mask"]),
                   scale=None if scale is None else float(scale), **canonical_precision(given), mode=mode,
                   rotate=given["rotate"], node_size=count("node_size", given["node_size"], " (ranks per node)"),
                   ulysses_size=count("ulysses_size", given["ulysses_size"], ""))
        for name in FUNCTIONS:  # what the functions read, once: Unreadable (a ValueError) names what is not
            spec.field_content(name)
        return spec

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    def fields(self):
        """The fields by name, as ``Spec.of`` takes them."""
        return {name: getattr(self, name) for name in FIELDS}

    # ------------------------------------------------------------------ the strategy

    @property
    def strategy(self):
        """The strategy table's key: "grid" (``ulysses_size``), "pass-q" (``rotate="q"``) or the mode.

        ``rotate="auto"`` is decided per call from the plan's bytes (``parallel.strategies.rotation``).
        """
        if self.ulysses_size is not None:
            return "grid"
        return "pass-q" if self.rotate == "q" else self.mode

    def head_split(self, size):
        """``(parts, who, what)`` when the strategy splits the heads into ``parts``, else None.

        Ulysses splits them over the ranks, the grid over each group's ``ulysses_size`` ranks.
        """
        if self.ulysses_size is not None:
            return self.ulysses_size, f"ulysses_size {self.ulysses_size}", "ulysses_size"
        if self.mode == "ulysses":
            return size, f"mode={self.mode!r}", "the number of ranks"
        return None

    def heads_problem(self, q, k, size):
        """Why the strategy cannot split the heads of this rank's q, k over ``size`` ranks, or None (never raises)."""
        if self.ulysses_size is not None:
            if self.mode not in MODES:
                return f"ulysses_size combines with mode ring, bidirectional or allgather, not {self.mode!r}"
            if size % self.ulysses_size:
                return f"ulysses_size {self.ulysses_size} does not divide the {size} ranks"
        split = self.head_split(size)
        return None if split is None else heads_problem(q, k, *split)

    def backward_problem(self):
        """Why a backward pass cannot run this spec (a score_mod without its derivative), or None."""
        if self.score_mod is not None and self.score_mod_grad is None:
            return (f"the score_mod {getattr(self.score_mod, '__qualname__', self.score_mod)!r} has no derivative: a "
                    f"backward pass needs score_mod_grad=fn(score, batch, head, q_pos, k_pos) -> d score_mod / d "
                    f"score (mpiring.torch derives it with autograd)")
        return None

    def scores_problem(self, q):
        """Why this rank's q does not fit the score and mask options (sinks per head, padding per batch entry),
        or None (never raises)."""
        heads = q.shape[-3] if q.ndim > 2 else 1
        if self.sinks is not None and len(self.sinks) != heads:
            return f"sinks has {len(self.sinks)} logits, but q has {heads} query heads: give one per head"
        probe = np.arange(2, dtype=np.int64)  # the functions tried on a 2 x 2 block before any data moves
        for piece in self.mask:
            try:
                piece.allows(probe[:, None], probe[None, :])
            except Exception as exc:  # noqa: BLE001 (a user's function: any error is the user's problem)
                return f"the mask {piece!r} fails on positions 0, 1: {type(exc).__name__}: {exc}"
        if isinstance(self.bias, TableBias) and self.bias.shape[0] != heads:
            return (f"the bias table has {self.bias.shape[0]} rows, but q has {heads} query heads: give one per "
                    f"head")
        for name in ("score_mod", "score_mod_grad"):
            fn = getattr(self, name)
            if fn is not None:
                tile = np.zeros((1, heads, 2, 2))
                try:
                    mod_values(fn, tile, tile_indices(1, np.arange(heads), probe, probe))
                except Exception as exc:  # noqa: BLE001
                    return (f"{name}(score, batch, head, q_pos, k_pos) fails on a (1, {heads}, 2, 2) tile of "
                            f"positions 0, 1: {type(exc).__name__}: {exc}")
        if self.bias is not None:
            try:
                extra = np.asarray(self.bias(np.arange(heads)[:, None, None], probe[None, :, None],
                                             probe[None, None, :]))
                if extra.dtype.kind not in "fiu":
                    return f"bias must return real numbers, got {extra.dtype}"
                np.broadcast_to(extra, (heads, 2, 2))
            except Exception as exc:  # noqa: BLE001
                return (f"bias(heads, q_pos, k_pos) must return an array broadcastable to (heads, queries, keys); "
                        f"on {heads} heads and 2 x 2 positions it gave {type(exc).__name__}: {exc}")
        for piece in (leaf for part in self.mask for leaf in part.leaves()):
            lengths = getattr(piece, "lengths", None)
            if lengths is not None and lengths.ndim and lengths.shape != q.shape[:-3]:
                return (f"{piece!r} gives lengths of shape {lengths.shape}, one per batch entry, but q's batch "
                        f"shape is {q.shape[:-3]}")
        return None

    def beyond(self, names, who):
        """Why ``who``, which takes only the fields ``names``, cannot run this spec (a field not at its default
        outside them), or None."""
        extra = [name for name in FIELDS if name not in names and _key(getattr(self, name)) != _key(DEFAULTS[name])]
        if not extra:
            return None
        return f"{who} takes only {', '.join(names)} from a spec; this one also sets {', '.join(extra)}"

    # ------------------------------------------------------------------ the plan

    @property
    def precision(self):
        """The precision options, as ``core.precision.Precision.of`` takes them."""
        return {name: getattr(self, name) for name in PRECISION}

    def plan_options(self):
        """What ``plans.make.make_plan`` takes besides the length and the ranks."""
        return dict(layout=self.layout, mode=self.mode, causal=self.causal, window=self.window,
                    cu_seqlens=self.cu_seqlens, causal_block=self.causal_block, mask=self.mask,
                    positions=self.positions,
                    kv_positions=self.kv_positions, node_size=self.node_size, ulysses_size=self.ulysses_size)

    def plan(self, size, seq_len=None):
        """The plan of ``size`` ranks; ``seq_len``: the length the ranks' shards imply (the spec's, if it has one,
        must equal it). Raises ValueError for what only the whole problem shows (positions that do not
        partition the sequence, cu_seqlens against its length, too few tokens)."""
        if seq_len is not None and self.seq_len is not None and seq_len != self.seq_len:
            raise ValueError(f"the spec says seq_len={self.seq_len}, but the ranks hold {seq_len} tokens")
        return make_plan(self.seq_len if seq_len is None else seq_len, size, **self.plan_options())

    def row_order(self, kind):
        """The sort of this rank's rows of one kind ("q", "l": queries; "k": keys) by position (None: sorted)."""
        name = "kv_positions" if kind == "k" and self.kv_positions is not None else "positions"
        return sort_order(getattr(self, name))

    def rows_problem(self, q, k):
        """Why this rank's positions do not fit its q and k rows, or None."""
        for name, a in (("positions", q), ("kv_positions", k)):
            p = getattr(self, name)
            if p is not None and len(p) != a.shape[-2]:
                what = "q" if name == "positions" else "k and v"
                return f"{name} has {len(p)} entries for the {a.shape[-2]} rows of {what}"
        return None

    def held(self):
        """This rank's own rows (its positions): what the agreement gathers from every rank instead of comparing."""
        return [getattr(self, name) for name in ROW_OPTIONS]

    def with_ranks(self, held):
        """The agreed spec: every rank's positions (``held[rank]``, as gathered) in place of this rank's.

        Also returns the keys' sequence length the positions imply (None when
        the layout places the tokens).
        """
        changes, seq_len = {}, None
        for i, name in enumerate(ROW_OPTIONS):
            if getattr(self, name) is not None:  # given on every rank: the agreement compared that
                changes[name] = [h[i] for h in held]
                seq_len = sum(len(p) for p in changes[name])
        return self.replace(**changes), seq_len

    # ------------------------------------------------------------------ what the lse remembers

    def made_by(self, size, scale, seq_len=None):
        """What a forward's lse depends on besides q, k, v, and its digest: the record an ``Lse`` carries, which
        the backward compares with its own (field by field when the digests differ).

        ``scale``: the call's (the default resolved); ``seq_len``: the sequence's, when known.
        """
        cu = self.cu_seqlens
        if cu is not None:
            cu = cu.tolist() if len(cu) <= 8 else f"{len(cu)} entries, sha1 {digest(cu)[:12]}"
        layout = "positions" if self.positions is not None else self.layout
        tag = {"layout": layout, "mode": self.mode, "causal": self.causal, "window": tuple(self.window),
               "cu_seqlens": cu, "causal_block": self.causal_block,
               "mask": tuple(f"{piece!r} ({digest(repr(piece.key()).encode())[:8]})" for piece in self.mask),
               "ranks": size, "scale": float(scale),
               "wire_dtype": self.wire_dtype}
        for name in ("softcap", "bias", "score_mod", "sinks", "dropout", "seed"):  # the scores, when given
            if _key(getattr(self, name)) != _key(DEFAULTS[name]):
                tag[name] = f"{_key(getattr(self, name))!r}"
                tag[name] = tag[name] if len(tag[name]) < 80 else digest(tag[name].encode())[:12]
        if seq_len is not None:
            tag["seq_len"] = seq_len
        tag["digest"] = digest(repr(sorted(tag.items())).encode())[:16]  # the whole record, compared first
        return tag

    def field_content(self, name):
        """A field's ``plans.content.Content``: what it is and reads, leaf by leaf (made once per spec)."""
        found = self._contents.get(name)
        if found is None:
            value = getattr(self, name)
            found = self._contents[name] = content(value, name, [repr(p) for p in value] if name == "mask" else None)
        return found

    @functools.cached_property
    def _contents(self):
        return {}

    def field_key(self, name):
        """A field as 16 hex digits of what it is (functions by everything they read, pieces by their fields)."""
        return self.field_content(name).digest

    @functools.cached_property
    def digest(self):
        """16 hex digits of every field (positions by content): equal specs have equal digests."""
        return digest(repr([(name, _key(getattr(self, name))) for name in FIELDS]).encode())[:16]


def _key(value):
    if isinstance(value, np.ndarray):
        return ("array", value.shape, digest(value))
    if isinstance(value, (list, tuple)):
        return [_key(v) for v in value]
    if isinstance(value, MaskPiece):
        return value.key()
    if callable(value):
        return ("function", content(value).digest)
    return value


def digest(data):
    """The project's one digest: sha1 hex of bytes, or of an array's dtype, shape and bytes."""
    if isinstance(data, np.ndarray):
        a = np.ascontiguousarray(data)
        data = str((a.dtype.str, a.shape)).encode() + a.view(np.uint8).tobytes()
    return hashlib.sha1(data).hexdigest()


def spec_problem(keywords, spec=None):
    """``(spec, None)`` from an entry point's keyword arguments, or ``(None, why)``; never raises.

    With a ``spec`` given, it is the spec, and a keyword given beside it (not
    None and not its default) must mean the same as the spec's field, or fill
    a field the spec leaves open (None: ``seq_len``, ``scale``, ...): a value
    that differs is refused rather than silently ignored. Entry points agree
    on the problem before any rank raises.
    """
    try:
        if spec is None:
            return Spec.of(**keywords), None
        if not isinstance(spec, Spec):
            return None, f"spec must be an mpiring.Spec, got {type(spec).__name__}"
        unknown = sorted(set(keywords) - set(FIELDS))
        if unknown:
            raise TypeError(f"unknown spec options {unknown}; the options are {', '.join(FIELDS)}")
        for name, value in keywords.items():
            default = FIELDS[name].default
            if value is None or (not isinstance(value, np.ndarray) and value == default):
                continue
            mine = Spec.of(**dict(spec.fields(), **{name: value}))
            if getattr(spec, name) is None:
                spec = mine  # the keyword fills what the spec left open
            elif _key(getattr(mine, name)) != _key(getattr(spec, name)):
                return None, (f"{name}={getattr(mine, name)!r} differs from the spec's {getattr(spec, name)!r}: "
                              f"give it in the spec only")
        return spec, None
    except (TypeError, ValueError) as exc:
        return None, str(exc)


FIELDS = {f.name: f for f in dataclasses.fields(Spec)}
DEFAULTS = {name: getattr(Spec(), name) for name in FIELDS}
