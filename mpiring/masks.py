"""Masks to build and combine: every entry point takes them as ``mask=`` (docs/masks.md).

    from mpiring import masks
    m = masks.causal() | masks.prefix(64)                   # a prefix LM
    m = masks.window(128, 0) | masks.function(lambda q, k: k < 4)   # a sliding window and 4 global tokens
    out, lse = mpiring.ring_attention(q, k, v, mask=m, layout="zigzag")

Each constructor gives a ``MaskPiece`` (``mpiring.plans.visibility``); ``a & b``
keeps the keys both allow, ``a | b`` those either allows. The options
``causal=``, ``window=``, ``cu_seqlens=`` and ``causal_block=`` are the pieces
``causal()``, ``window()``, ``documents()`` and ``frames()``, and a call's mask
is all of its pieces together (``&``). ``parse`` reads the command line's
``--mask`` text. Score modifiers are options of their own (``softcap=``,
``bias=``, ``score_mod=``, ``sinks=``, ``dropout=``); ``alibi(H)`` is ALiBi's bias, ``TableBias`` a learnable
bias table (``t5_bias``: T5's relative position buckets).
"""

import numpy as np

from .core.modifiers import TableBias, relative_buckets, t5_bias
from .core.scores import alibi, alibi_slopes
from .plans.indexer import Selected
from .plans.visibility import (
    And,
    Causal,
    Documents,
    Function,
    MaskPiece,
    Or,
    Padding,
    Prefix,
    Window,
    check_cu_seqlens,
    check_window,
)

__all__ = ["causal", "window", "documents", "frames", "prefix", "padding", "function", "selected", "parse", "alibi",
           "alibi_slopes", "TableBias", "t5_bias", "relative_buckets", "MaskPiece", "And", "Or"]


def causal():
    """Key j visible to query i iff j <= i."""
    return Causal()


def window(left, right=0):
    """Keys i - left .. i + right visible to query i (-1 or None: that side unbounded), as flash-attn's."""
    return Window(*check_window((left, right)))


def documents(cu_seqlens):
    """Packed documents ``[0, e1, ..., S]``: a query sees the keys of its own document only."""
    cu = np.asarray(cu_seqlens)
    return Documents(check_cu_seqlens(cu, int(cu[-1]) if cu.ndim == 1 and cu.size else 0))


def frames(size):
    """Block-causal video frames of ``size`` tokens: key j visible to query i iff j // size <= i // size."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"frames(size) takes a positive frame size, got {size!r}")
    return Causal(int(size))


def prefix(n):
    """The first ``n`` tokens see each other; combine with ``causal()`` by ``|`` for a prefix LM."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"prefix(n) takes a number of tokens n >= 0, got {n!r}")
    return Prefix(int(n))


def padding(lengths):
    """Per batch entry b, the keys at or past ``lengths[b]`` are hidden (a padded batch; one length per entry
    of q's batch axes)."""
    a = np.asarray(lengths)
    if a.dtype.kind not in "iu" or np.any(a < 0):
        raise ValueError(f"padding(lengths) takes lengths >= 0, one per batch entry; got {lengths!r}")
    return Padding(a.astype(np.int64))


def function(fn):
    """Any mask: ``fn(q_pos, k_pos) -> bool array``, evaluated with NumPy on broadcast blocks of global positions
    (flex-attention's ``mask_mod``, vectorized). The same function on every rank."""
    return Function(fn)


def selected(chosen, block=1, causal=True):
    """Top-k blocks: query t sees key s iff block ``s // block`` is in ``chosen[t]`` (and s <= t if ``causal``);
    ``chosen`` (S, k) holds every query position's block indices, -1 for none. ``mpiring.select_topk`` makes
    one from an indexer's scores (docs/masks.md)."""
    a = np.asarray(chosen)
    if a.ndim != 2 or a.dtype.kind not in "iu" or np.any(a < -1):
        raise ValueError(f"selected(chosen) takes an integer array (positions, k) of block indices or -1; got "
                         f"{a.dtype} of shape {a.shape}")
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)) or block < 1:
        raise ValueError(f"selected(chosen, block) takes a positive block size, got {block!r}")
    if np.any(a >= -(-len(a) // block)):
        raise ValueError(f"selected: a block index is past the last block of {len(a)} positions")
    return Selected(a, int(block), bool(causal))


_NAMED = {"causal": lambda: causal(), "prefix": lambda n: prefix(int(n)), "frames": lambda n: frames(int(n)),
          "window": lambda a, b="0": window(int(a), int(b)),
          "documents": lambda *ends: documents([int(e) for e in ends])}


def parse(text):
    """A mask from text: pieces ``causal``, ``prefix:N``, ``frames:F``, ``window:L,R``, ``documents:0,E1,...,S``
    joined by ``&`` (binds first) and ``|``, e.g. ``causal|prefix:64`` or ``window:128,0&documents:0,100,256``."""
    alternatives = []
    for part in text.split("|"):
        pieces = []
        for item in part.split("&"):
            name, _, args = item.strip().partition(":")
            if name not in _NAMED:
                raise ValueError(f"unknown mask piece {name!r} in {text!r}; pieces: {', '.join(_NAMED)} "
                                 f"(joined by & and |)")
            try:
                pieces.append(_NAMED[name](*[a for a in args.split(",") if a.strip()]))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"mask piece {item.strip()!r}: {exc}") from None
        alternatives.append(pieces[0] if len(pieces) == 1 else And(*pieces))
    return alternatives[0] if len(alternatives) == 1 else Or(*alternatives)
