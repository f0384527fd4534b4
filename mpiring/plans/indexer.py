"""Top-k attention chosen by an indexer: each query's k key blocks, as a mask piece. No MPI.

A cheap scoring pass (the indexer) ranks the key blocks of ``block`` tokens
(global positions ``b * block .. (b + 1) * block - 1``) for every query, and
each query keeps its ``topk`` best. Two indexers:

- ``"relu"`` (DeepSeek's lightning indexer): a few low-dimensional heads,
  token score ``I(t, s) = sum_j w[j, t] * relu(q_I[j, t] . k_I[s])``; a block
  scores the largest I over its keys the query may see (``block=1``: tokens).
- ``"mean"`` (the selection of MoBA and NSA): a block's key is the mean of its
  indexer keys, per head; the score is ``sum_h q_I[h, t] . mean_h(block)``.

Under ``causal`` a query ranks only blocks that start at or before it. Its
own block is always among its k (MoBA's rule), so every row sees a key. Ties
go to the lower block. Scores are sums of products taken along the head dim
one (query, key) at a time, never by a matrix product whose rounding could
depend on how many rows a rank holds: the same inputs give the same choice
for any number of ranks and any layout (``select``).

The choice is a ``Selected`` mask piece (``masks.MaskPiece``): query ``t``
sees key ``s`` iff ``s``'s block is among ``t``'s chosen ones (and ``s <= t``
under ``causal``). It holds the choice of every query position, the same on
every rank, so every strategy runs it as any mask with holes; under
``mode="sparse"`` only the chosen keys travel (``sparse_keys``).
"""

import hashlib

import numpy as np

from .visibility import BIG, MaskPiece

__all__ = ["INDEXERS", "Selected", "select", "block_scores", "choose", "dots", "topk_problem"]

INDEXERS = ("relu", "mean")
_CHUNK = 1 << 21  # products held at once by ``dots``
_TABLE = 1 << 26  # a dense (query, block) table up to this many entries; sorted codes beyond


def dots(a, b):
    """``a @ b.T`` for (n, d) and (m, d) float64 arrays, each entry summed on its own along d (its bits do not
    depend on n or on the row's place in ``a``)."""
    out = np.empty((a.shape[0], b.shape[0]), np.float64)
    step = max(1, _CHUNK // max(1, b.size))
    for i in range(0, a.shape[0], step):
        np.sum(a[i:i + step, None, :] * b[None, :, :], axis=-1, out=out[i:i + step])
    return out


def topk_problem(topk, block, indexer, index_q, index_k, weights):
    """Why these indexer options and arrays (this rank's) cannot choose blocks, or None (never raises)."""
    for name, n in (("topk", topk), ("block", block)):
        if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
            return f"{name} must be a positive integer, got {n!r}"
    if indexer not in INDEXERS:
        return f"indexer must be one of {', '.join(INDEXERS)}; got {indexer!r}"
    for name, a, ndim in (("index_q", index_q, 3), ("index_k", index_k, 3)):
        if not isinstance(a, np.ndarray) or a.ndim != ndim or a.dtype.kind != "f":
            return (f"{name} must be a float array (heads, tokens, dim), got "
                    f"{getattr(a, 'dtype', type(a).__name__)} of shape {getattr(a, 'shape', None)}")
    if index_q.shape[-1] != index_k.shape[-1] or 0 in index_q.shape[::2]:
        return f"index_q and index_k must share a positive head dim, got {index_q.shape} and {index_k.shape}"
    heads = index_q.shape[0]
    if index_k.shape[0] != (1 if indexer == "relu" else heads):
        want = "1 head for indexer 'relu' (its heads share one key)" if indexer == "relu" else \
            f"{heads} heads for indexer 'mean', as index_q"
        return f"index_k must have {want}, got {index_k.shape[0]}"
    if weights is not None and (indexer != "relu" or not isinstance(weights, np.ndarray)
                                or weights.shape != index_q.shape[:2]):
        return (f"weights must be an array (heads, tokens) {index_q.shape[:2]} for indexer 'relu' (none for "
                f"'mean'), got {getattr(weights, 'shape', weights)!r}")
    for name, a in (("index_q", index_q), ("index_k", index_k), ("weights", weights)):
        if a is not None and not np.all(np.isfinite(a)):
            return f"{name} has NaN or Inf values"
    return None


def block_scores(index_q, keys, weights, q_pos, block, indexer, causal):
    """Scores (n, blocks) of the n queries at ``q_pos`` (``index_q`` (heads, n, d)) against every key block of
    the whole sequence's indexer keys ``keys`` (heads, S, d), float64."""
    S = keys.shape[1]
    n_blocks = -(-S // block)
    q = np.asarray(index_q, np.float64)
    k = np.asarray(keys, np.float64)
    if indexer == "mean":  # each block's keys summed in position order, then divided: the same on every rank
        ends = np.minimum(np.arange(1, n_blocks + 1) * block, S)
        sums = np.add.reduceat(k, np.arange(0, S, block), axis=1)
        means = sums / (ends - np.arange(0, S, block))[None, :, None]
        return sum(dots(q[h], means[h]) for h in range(q.shape[0]))
    w = np.ones(q.shape[:2]) if weights is None else np.asarray(weights, np.float64)
    scores = sum(w[j][:, None] * np.maximum(dots(q[j], k[0]), 0) for j in range(q.shape[0]))
    if causal:
        scores[np.arange(S)[None, :] > q_pos[:, None]] = -np.inf
    padded = np.full((len(q_pos), n_blocks * block), -np.inf)
    padded[:, :S] = scores
    return padded.reshape(len(q_pos), n_blocks, block).max(axis=-1)


def choose(scores, q_pos, block, topk, causal):
    """Each query's ``topk`` blocks (n, min(topk, blocks)), ascending, -1 where it has fewer candidates: its own
    block first, then the highest scores, the lower block on a tie; under ``causal`` none after the query."""
    scores = np.array(scores, np.float64)
    n, n_blocks = scores.shape
    rows, own = np.arange(n), q_pos // block
    if causal:
        scores[np.arange(n_blocks)[None, :] > own[:, None]] = -np.inf
    scores[rows, own] = np.inf
    order = np.argsort(-scores, axis=1, kind="stable")[:, :topk]  # stable: equal scores keep the lower block first
    kept = np.where(np.take_along_axis(scores, order, axis=1) > -np.inf, order, n_blocks)
    kept.sort(axis=1)
    return np.where(kept == n_blocks, -1, kept)


def select(index_q, keys, q_pos, *, topk, block=1, weights=None, indexer="relu", causal=True, seq_len=None):
    """The chosen blocks (n, k) of the queries at ``q_pos`` given the whole sequence's indexer ``keys``, a chunk
    of queries at a time (``block_scores``, ``choose``)."""
    q_pos = np.asarray(q_pos, np.int64)
    step = max(1, _CHUNK // max(1, keys.shape[1] * keys.shape[2]))
    parts = [choose(block_scores(index_q[:, i:i + step], keys, None if weights is None else weights[:, i:i + step],
                                 q_pos[i:i + step], block, indexer, causal), q_pos[i:i + step], block, topk, causal)
             for i in range(0, len(q_pos), step)]
    width = min(topk, -(-keys.shape[1] // block))
    return np.concatenate(parts) if parts else np.empty((0, width), np.int64)


class Selected(MaskPiece):
    """Query position t sees key position s iff ``s // block`` is one of ``chosen[t]`` (and ``s <= t`` when
    ``causal``); ``chosen`` (S, k): every query position's blocks, -1 for none."""

    exact = False  # holes: the plan counts visible pairs from ``allows``, the kernel evaluates it per tile
    sparse_keys = True  # under mode="sparse" only the keys some query of the receiving rank sees travel

    def __init__(self, chosen, block, causal=True):
        self.chosen = np.asarray(chosen, np.int64)
        self.block, self.causal = int(block), bool(causal)
        self._lookup = None

    def __getstate__(self):  # the lookup table is made again where needed
        return dict(vars(self), _lookup=None)

    @property
    def seq_len(self):
        return self.chosen.shape[0]

    @property
    def blocks(self):
        return -(-self.seq_len // self.block)

    def problem(self, seq_len):
        if seq_len != self.seq_len:
            return f"{self!r} chose blocks for {self.seq_len} query positions, but the sequence has {seq_len}"
        return None

    def key(self):
        digest = hashlib.sha1(np.ascontiguousarray(self.chosen).tobytes()).hexdigest()
        return (type(self).__qualname__, self.block, self.causal, self.chosen.shape, digest)

    def bounds(self, q_pos):
        lo = np.full(np.shape(q_pos), -BIG, np.int64)
        return lo, (np.asarray(q_pos, np.int64) if self.causal else np.full(np.shape(q_pos), BIG, np.int64))

    def _table(self):
        """Made once: a (query, block) bool table, or the sorted codes query * blocks + block of the choices."""
        if self._lookup is None:
            rows = np.repeat(np.arange(self.seq_len), self.chosen.shape[1])
            picked = self.chosen.reshape(-1)
            rows, picked = rows[picked >= 0], picked[picked >= 0]
            if self.seq_len * self.blocks <= _TABLE:
                table = np.zeros((self.seq_len + 1, self.blocks), bool)  # the last row: a position beyond
                table[rows, picked] = True
                self._lookup = table
            else:
                self._lookup = np.unique(rows * self.blocks + picked)
        return self._lookup

    def allows(self, q_pos, k_pos):
        q, k = np.broadcast_arrays(np.asarray(q_pos, np.int64), np.asarray(k_pos, np.int64))
        inside = (q >= 0) & (q < self.seq_len) & (k >= 0) & (k < self.seq_len)
        q, b = np.where(inside, q, self.seq_len), np.where(inside, k // self.block, 0)
        table = self._table()
        if table.ndim == 2:
            seen = table[q, b]
        else:
            code = q * self.blocks + b
            at = np.minimum(np.searchsorted(table, code), len(table) - 1)
            seen = (table[at] == code) if len(table) else np.zeros(code.shape, bool)
        seen &= inside
        return seen & (k <= q) if self.causal else seen

    def __repr__(self):
        return (f"Selected(top {self.chosen.shape[1]} blocks of {self.block} of {self.seq_len} positions"
                f"{', causal' if self.causal else ''})")
