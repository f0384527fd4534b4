"""A KV cache sharded over the ranks: prefill through the ring, extend token by token, decode over MPI.

    mpiexec -n 4 python -m mpiring generate --prompt-len 4096 --new-tokens 16 --heads 8 --kv-heads 2 --dim 64

Every rank keeps its share of the cached tokens. ``placement`` says whose
share a token joins: "round_robin" (vLLM/SGLang's interleaved placement: global
position p lives on rank p mod P) or "contiguous" (the prompt in contiguous
blocks, each new token to the rank with the fewest, the lowest such rank);
either way shards stay within one token of each other. ``attend`` is
``decode_attention`` over the shards: every rank gets the same bits.

``quantize`` stores the cache compressed and dequantizes it one tile
(``TILE`` tokens) at a time during ``attend``:

- "float16": every value rounded to float16 (half the bytes of float32);
- "int8": per token and head, the values divided by their absmax / 127 and
  rounded; the scale kept in float32. Per token and head that is D + 4 bytes
  against 4 D for float32: 0.27 of it at D = 64.
"""

import time

import numpy as np

from .decode import decode_agreement, decode_timeout, local_partial, merge_partials, packed, spec_of, unpacked
from .handle import ring_attention
from .mpi.agree import agree, agreed, check_comm, gather_entry
from .mpi.checks import describe, timeout_problem, verdict
from .mpi.comm import RingComm
from .mpi.record import Record
from .mpi.waits import exclusive
from .plans.layouts import layout_positions
from .plans.spec import digest

__all__ = ["KVCache", "PLACEMENTS", "QUANTIZE", "TILE", "ERROR_BOUND", "quantize"]

PLACEMENTS = ("round_robin", "contiguous")
QUANTIZE = (None, "float16", "int8")
TILE = 4096  # cached tokens dequantized at a time by ``attend``
# largest error of a decode step against the float64 reference that the tests and ``generate`` accept, for
# standard-normal q, k, v (measured at head dim 64: about 2e-4 for float16, 7e-3 for int8; docs/inference.md)
ERROR_BOUND = {"float16": 1e-3, "int8": 2.5e-2}


def quantize(x, how):
    """``x`` (..., n, D) as stored: ``(values, scales)``; scales (..., n) float32 for int8, else None."""
    if how is None:
        return x, None
    if how == "float16":
        return x.astype(np.float16), None
    peak = np.abs(x).max(axis=-1)
    scales = np.where(peak > 0, peak / 127, 1).astype(np.float32)
    return np.rint(x / scales[..., None]).astype(np.int8), scales


def _grown(old, n, cap, shape, dtype, ones=False):
    """A store of ``shape + (cap,)`` holding ``old``'s first ``n`` tokens (last axis); ``ones``: one more row, all 1."""
    new = np.empty(shape[:-1] + (shape[-1] + 1, cap) if ones else shape + (cap,), dtype)
    if ones:
        new[..., -1, :] = 1
    if old is not None:
        new[..., :n] = old[..., :n]
    return new


class KVCache:
    """This rank's share of a KV cache over ``comm``; construction, prefill, extend and attend are collective.

    Args:
        comm: an mpi4py communicator; every rank constructs the cache alike.
        kv_heads, head_dim: K/V heads and their dim (V's dim: ``value_dim``, default head_dim).
        dtype: float32 or float64, the dtype of q, k, v given to the cache and of its results.
        quantize: None, "float16" or "int8": how the cache is stored.
        placement: "round_robin" or "contiguous": which rank keeps each token.
        timeout: as ``ring_attention``, for every call.

    Bad arguments on any rank raise the same ValueError on every rank.
    """

    def __init__(self, comm, kv_heads, head_dim, *, dtype=np.float32, quantize=None, placement="round_robin",
                 value_dim=None, timeout="auto"):
        self.comm = check_comm(comm)
        problem = values = None
        try:
            value_dim = head_dim if value_dim is None else value_dim
            for name, n in (("kv_heads", kv_heads), ("head_dim", head_dim), ("value_dim", value_dim)):
                if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
                    problem = problem or f"{name} must be a positive integer, got {n!r}"
            if np.dtype(dtype) not in (np.float32, np.float64):
                problem = problem or f"dtype must be float32 or float64, got {np.dtype(dtype)}"
            if quantize not in QUANTIZE:
                problem = problem or f"quantize must be None, 'float16' or 'int8'; got {quantize!r}"
            if placement not in PLACEMENTS:
                problem = problem or f"placement must be one of {', '.join(PLACEMENTS)}; got {placement!r}"
            problem = problem or timeout_problem(timeout)
            values = repr((kv_heads, head_dim, value_dim, np.dtype(dtype).name, quantize, placement, timeout))
        except Exception as exc:  # reported collectively, never raised alone
            problem = describe(exc)
        with exclusive(self.comm):
            metas = agreed(self.comm, problem, None, timeout, values, entry=True)
        message = verdict([None if m == metas[0] else f"options {m} differ from rank 0's {metas[0]}" for m in metas])
        if message:
            raise ValueError(message)
        self.kv_heads, self.head_dim, self.value_dim = int(kv_heads), int(head_dim), int(value_dim)
        self.dtype, self.quantize, self.placement, self.timeout = np.dtype(dtype), quantize, placement, timeout
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.lengths = [0] * self.size  # every rank's cached tokens, the same list on every rank
        self._lead = None  # batch axes, from the first tokens
        self._n = 0
        self._store = None  # [k values, k scales, v values, v scales], tokens on the last axis (see _append)
        self._pos = np.empty(0, np.int64)
        self._k_peak = 0.0
        self._ring = None  # a private RingComm for merge="ring", made at the first such attend

    # ---------------------------------------------------------------- what it holds

    def __len__(self):
        """Tokens in the whole cache (every rank's together)."""
        return sum(self.lengths)

    @property
    def positions(self):
        """Global positions of this rank's cached tokens, sorted."""
        return self._pos[:self._n].copy()

    @property
    def nbytes(self):
        """Bytes of this rank's cached tokens as stored: values (unquantized: with the kernel's row of ones), scales."""
        if self._store is None:
            return 0
        return sum(a.nbytes // a.shape[-1] for a in self._store if a is not None) * self._n

    def prompt_positions(self, prompt_len):
        """The positions of a prompt of ``prompt_len`` tokens that this rank keeps under the placement."""
        if self.placement == "round_robin":
            return np.arange(self.rank, prompt_len, self.size)
        return layout_positions(prompt_len, self.size, "contiguous")[self.rank]

    def shard(self):
        """This rank's cached ``(k, v)`` dequantized, (..., Hk, n, D), in position order (``attend`` works per tile)."""
        return tuple(np.swapaxes(t[..., :-1, :], -1, -2) for t in self._tile(0, self._n)[:2])

    # ---------------------------------------------------------------- filling it

    def prefill(self, q, k, v, positions=None, *, causal=True, scale=None, record=None, **options):
        """Attention over the prompt through the ring (``ring_attention``); this rank keeps its K/V rows.

        ``q, k, v`` are this rank's prompt rows at ``positions`` (default:
        ``prompt_positions`` of the whole prompt; any partition of the prompt
        works, the placement then rules only the tokens that ``extend`` adds).
        Returns this rank's ``(out, lse)`` in the order of its rows. ``options``
        go to ``ring_attention`` (e.g. ``rotate``).
        """
        opens = positions is not None  # else the all-gather of the prompt's length opens the call
        if positions is None:
            with exclusive(self.comm):
                total = sum(gather_entry(self.comm, int(np.shape(q)[-2]) if np.ndim(q) >= 2 else 0, self.timeout))
            positions = self.prompt_positions(total)
        rec = Record(self.rank) if record is None else record
        problem = None if not len(self) else f"prefill needs an empty cache; it holds {len(self)} tokens"
        with exclusive(self.comm):
            agree(self.comm, problem or self._shape_problem(k, v), self.timeout, entry=opens)
        out, lse = ring_attention(q, k, v, self.comm, causal=causal, scale=scale, positions=positions,
                                  timeout=self.timeout, record=rec, **options)
        self.lengths = [len(s) for s in rec.plan.kv_shards]
        order = np.argsort(np.asarray(positions, np.int64), kind="stable")
        self._append(np.asarray(k)[..., order, :], np.asarray(v)[..., order, :],
                     np.asarray(positions, np.int64)[order])
        return out, lse

    def extend(self, k, v):
        """Append new tokens (``k, v`` (..., kv_heads, T, D), the same on every rank): each owner keeps its own."""
        with exclusive(self.comm):
            problem = values = None
            try:
                problem = self._shape_problem(k, v)
                if problem is None:
                    values = (k.shape, v.shape, _bytes_digest(k), _bytes_digest(v))
            except Exception as exc:  # reported collectively, never raised alone
                problem = describe(exc)
            metas = agreed(self.comm, problem, None, self.timeout, values, entry=True)
            message = verdict([None if m == metas[0] else "k and v differ from rank 0's: extend takes the same new "
                               "tokens on every rank" for m in metas])
            if message:
                raise ValueError(message)
        first = len(self)
        owners = self._owners(k.shape[-2])
        mine = np.flatnonzero(owners == self.rank)
        for r in owners:
            self.lengths[r] += 1
        self._append(k[..., mine, :], v[..., mine, :], first + mine)

    def _owners(self, n):
        """The rank that keeps each of ``n`` new tokens (positions len(self) ...), the same on every rank."""
        if self.placement == "round_robin":
            return (len(self) + np.arange(n)) % self.size
        lengths, owners = list(self.lengths), []
        for _ in range(n):
            r = int(np.argmin(lengths))
            owners.append(r)
            lengths[r] += 1
        return np.array(owners, np.int64)

    def _shape_problem(self, k, v):
        for name, a, dim in (("k", k, self.head_dim), ("v", v, self.value_dim)):
            if not isinstance(a, np.ndarray) or a.dtype != self.dtype:
                return f"{name} must be a {self.dtype} array"
            if a.ndim < 3 or a.shape[-3] != self.kv_heads or a.shape[-1] != dim:
                return f"{name} must have shape (..., {self.kv_heads}, tokens, {dim}), got {a.shape}"
            if self._lead is not None and a.shape[:-3] != self._lead:
                return f"{name} must have the cache's batch axes {self._lead}, got {a.shape}"
        if k.shape[:-1] != v.shape[:-1]:
            return f"k and v must agree on all but the last axis, got {k.shape} and {v.shape}"
        return None

    def _append(self, k, v, positions):
        """Store this rank's new rows (position order) after its others, growing the store by doubling.

        Tokens lie on the last axis: k as (..., Hk, D, capacity) (unquantized: the
        kernel's [k | 1]^T, D + 1 rows, the last all ones), scales (..., Hk, capacity).
        """
        if self._store is None:
            self._lead = k.shape[:-3]
            self._store = [None] * 4
        n = k.shape[-2]
        need = self._n + n
        cap = self._pos.shape[0]
        if need > cap or self._store[0] is None:
            cap = max(need, 2 * cap, 16)
            for i, dim in ((0, self.head_dim), (2, self.value_dim)):
                self._store[i] = _grown(self._store[i], self._n, cap, self._lead + (self.kv_heads, dim),
                                        {None: self.dtype, "float16": np.float16, "int8": np.int8}[self.quantize],
                                        ones=self.quantize is None)
                if self.quantize == "int8":
                    self._store[i + 1] = _grown(self._store[i + 1], self._n, cap, self._lead + (self.kv_heads,),
                                                np.float32)
            self._pos = np.concatenate([self._pos[:self._n], np.empty(cap - self._n, np.int64)])
        if n:
            self._k_peak = max(self._k_peak, float(np.abs(k).max()))
        for i, x in ((0, k), (2, v)):
            values, scales = quantize(x, self.quantize)
            self._store[i][..., :x.shape[-1], self._n:need] = np.swapaxes(values, -1, -2)
            if scales is not None:
                self._store[i + 1][..., self._n:need] = scales
        self._pos[self._n:need] = positions
        self._n = need

    # ---------------------------------------------------------------- decoding

    def _tile(self, a, b):
        """This rank's cached tokens a:b as ``(kt, vt, positions)``: the kernel's padded form, in the cache's dtype.

        Unquantized: views of the store, no copy. Quantized: dequantized into new [x | 1]^T arrays.
        """
        if self._store is None:
            return (np.ones((self.kv_heads, self.head_dim + 1, 0), self.dtype),
                    np.ones((self.kv_heads, self.value_dim + 1, 0), self.dtype), self._pos[:0])
        tiles = []
        for i in (0, 2):
            values = self._store[i][..., a:b]
            if self.quantize is None:
                tiles.append(values)
                continue
            out = np.empty(values.shape[:-2] + (values.shape[-2] + 1, b - a), self.dtype)
            out[..., :-1, :] = values
            if self._store[i + 1] is not None:
                out[..., :-1, :] *= self._store[i + 1][..., None, a:b]
            out[..., -1, :] = 1
            tiles.append(out)
        return tiles[0], tiles[1], self._pos[a:b]

    def attend(self, q, *, causal=False, positions=None, merge="tree", scale=None, record=None, spec=None):
        """``decode_attention`` of ``q`` (..., Hq, T, D), the same on every rank, over the whole cache.

        Every rank returns the same ``(out, lse)``. With ``causal``, query i sees
        the cached tokens at positions <= positions[i] (default: the last T
        positions, the tokens just added with ``extend``). ``spec``: a ``Spec``
        giving ``scale``, ``causal`` and ``positions`` instead (the cache knows
        where its keys are).
        """
        with exclusive(self.comm):
            (scale, causal, positions, _), problem = spec_of(spec, scale, causal, positions, None,
                                                             who="KVCache.attend")
            if causal and positions is None:
                positions = np.arange(len(self) - np.shape(q)[-2], len(self)) if np.ndim(q) >= 2 else None
            lead = self._lead if self._lead is not None else np.shape(q)[:-3]
            k_like, v_like = (np.broadcast_to(np.zeros((), self.dtype), lead + (self.kv_heads, self._n, d))
                              for d in (self.head_dim, self.value_dim))
            problem = problem or (None if isinstance(q, np.ndarray) and q.dtype == self.dtype else
                                  f"q must be a {self.dtype} array, as the cache")
            scale, lengths = decode_agreement(self.comm, q, k_like, v_like, scale, self.timeout, merge, causal,
                                              positions, self._pos[:self._n], k_peak=self._k_peak, problem=problem)
            timeout = decode_timeout(self.timeout, q, v_like, lengths)
            rec = Record(self.rank) if record is None else record
            start = time.perf_counter()
            q = np.ascontiguousarray(q)
            positions = None if positions is None else np.asarray(positions, np.int64)
            blocks = (self._tile(a, min(a + TILE, self._n)) for a in range(0, max(self._n, 1), TILE))
            out, lse = local_partial(q, blocks, scale, positions, causal, padded=True)
            rec.compute_time += rec.event("compute", start, kind="decode") - start
            if merge == "ring" and self._ring is None and self.size > 1:
                self._ring = RingComm(self.comm, timeout)
            rows = merge_partials(packed(out, lse), self.comm, merge, timeout, ring=self._ring, rec=rec)
            rec.wall_time = time.perf_counter() - start
            return unpacked(rows, out.shape, q.dtype)

    def close(self):
        """Free the private communicator of the ring merge (if one was made)."""
        if self._ring is not None:
            self._ring.free()
            self._ring = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _bytes_digest(a):
    return digest(np.ascontiguousarray(a).view(np.uint8))
