"""Problems to test on: a hypothesis strategy constrained to what the code under test supports, and shape helpers.

``attention_problems`` builds its constraints into the draws (sequence lengths that divide by P,
head counts that are multiples of P, grouped-query or not, chosen dtypes and masks), so no draw
is filtered out. The helpers move between the layouts third-party code uses: a rank's sequence
shard (``local_shards``), its heads (``head_indices``, ``head_shard``), and (B, S, H*D) activations
(``split_heads``, ``merge_heads``).
"""

from dataclasses import dataclass

import numpy as np

from ..plans.layouts import shard, shard_indices

__all__ = ["MASKS", "AttentionProblem", "attention_problems", "head_indices", "head_shard", "local_shards",
           "merge_heads", "split_heads"]

MASKS = ("causal", "window", "documents")  # the mask kinds attention_problems may draw


def local_shards(arrays, comm, layout="contiguous"):
    """This rank's shards of full arrays (sequence on axis -2) and its token positions."""
    seq_len = arrays[0].shape[-2]
    pieces = [np.ascontiguousarray(shard(a, comm.Get_size(), comm.Get_rank(), layout)) for a in arrays]
    return pieces, shard_indices(seq_len, comm.Get_size(), comm.Get_rank(), layout)


def head_indices(heads, P, rank):
    """The heads rank ``rank`` of ``P`` holds in a head-parallel split: ``heads / P`` consecutive ones."""
    if P < 1 or heads % P:
        raise ValueError(f"{heads} heads cannot be split evenly over {P} ranks")
    per = heads // P
    return np.arange(rank * per, (rank + 1) * per)


def head_shard(x, P, rank, axis=-3):
    """Rank ``rank``'s heads of ``x`` (heads on ``axis``, default the H of (..., H, S, D))."""
    x = np.asarray(x)
    return np.ascontiguousarray(np.take(x, head_indices(x.shape[axis], P, rank), axis=axis))


def split_heads(x, heads):
    """(..., S, H*D) activations as (..., H, S, D): head h is columns h*D:(h+1)*D."""
    x = np.asarray(x)
    if x.ndim < 2 or x.shape[-1] % heads:
        raise ValueError(f"cannot split the last axis of shape {x.shape} into {heads} heads")
    return np.moveaxis(x.reshape(x.shape[:-1] + (heads, x.shape[-1] // heads)), -2, -3)


def merge_heads(x):
    """(..., H, S, D) as (..., S, H*D), the inverse of ``split_heads``."""
    x = np.moveaxis(np.asarray(x), -3, -2)
    return x.reshape(x.shape[:-2] + (x.shape[-2] * x.shape[-1],))


@dataclass(frozen=True)
class AttentionProblem:
    """One drawn problem: shapes and mask options valid for ``P`` ranks (seq_len >= P)."""

    P: int
    seq_len: int
    heads: int
    kv_heads: int
    dim: int
    dtype: type
    causal: bool
    window: tuple | None
    cu_seqlens: tuple | None
    batch: int | None = None  # None: no batch axis

    @property
    def options(self):
        """The mask options as keyword arguments for ``reference`` (and for mpiring.ring_attention)."""
        cu = None if self.cu_seqlens is None else np.array(self.cu_seqlens)
        return {"causal": self.causal, "window": self.window, "cu_seqlens": cu}

    def arrays(self, seed=0):
        """Full q ([batch,] heads, S, dim), k and v ([batch,] kv_heads, S, dim) in ``dtype``; the same per seed."""
        rng = np.random.default_rng(seed)
        lead = () if self.batch is None else (self.batch,)
        q = rng.standard_normal(lead + (self.heads, self.seq_len, self.dim)).astype(self.dtype)
        k = rng.standard_normal(lead + (self.kv_heads, self.seq_len, self.dim)).astype(self.dtype)
        v = rng.standard_normal(lead + (self.kv_heads, self.seq_len, self.dim)).astype(self.dtype)
        return q, k, v


def _mask_kinds(masks):
    if masks is True:
        return MASKS
    kinds = tuple(masks or ())
    unknown = set(kinds) - set(MASKS)
    if unknown:
        raise ValueError(f"unknown mask kinds {sorted(unknown)}; choose from {', '.join(MASKS)}")
    return kinds


def attention_problems(P, dtype=np.float64, max_tokens_per_rank=8, max_heads=4, max_dim=16, masks=True, *,
                       divisible=False, heads_divisible=False, gqa=None, dtypes=None, batch=None):
    """A hypothesis strategy of ``AttentionProblem``s for ``P`` ranks, every draw valid (none filtered out).

    Args:
        P: ranks; seq_len is in [P, P * max_tokens_per_rank].
        dtype: the arrays' dtype; ``dtypes``: several to draw from instead.
        max_heads: most query heads (at least what the constraints need); kv_heads divides heads.
        masks: True (causal or not, an optional sliding window (left, right) with -1 unbounded,
            optional packed documents cu_seqlens), False (none), or the kinds that may be drawn:
            a subset of ``MASKS`` ("causal", "window", "documents").
        divisible: seq_len a multiple of P (equal shards).
        heads_divisible: heads and kv_heads multiples of P (head-parallel code: Ulysses).
        gqa: True: fewer K/V heads than query heads; False: as many; None: either.
        batch: None (no batch axis) or the largest batch size drawn (a leading axis).
    """
    from hypothesis import strategies as st

    if P < 1 or max_tokens_per_rank < 1:
        raise ValueError(f"need P >= 1 and max_tokens_per_rank >= 1, got {P}, {max_tokens_per_rank}")
    kinds = _mask_kinds(masks)
    choices = [np.dtype(d).type for d in (dtypes if dtypes else [dtype])]
    unit = P if heads_divisible else 1  # K/V heads come in multiples of unit
    group_min = 2 if gqa else 1  # query heads per K/V head

    @st.composite
    def problems(draw):
        if divisible:
            seq_len = P * draw(st.integers(1, max_tokens_per_rank))
        else:
            seq_len = draw(st.integers(P, P * max_tokens_per_rank))
        kv_units = draw(st.integers(1, max(1, max_heads // (unit * group_min))))
        kv_heads = unit * kv_units
        group = 1 if gqa is False else draw(st.integers(group_min, max(group_min, max_heads // kv_heads)))
        dim = draw(st.integers(1, max_dim))
        causal = "causal" in kinds and draw(st.booleans())
        window = None
        if "window" in kinds and draw(st.booleans()):
            side = st.integers(-1, seq_len)
            window = (draw(side), draw(side))
        cu_seqlens = None
        if "documents" in kinds and draw(st.booleans()):
            inner = draw(st.lists(st.integers(1, max(1, seq_len - 1)), max_size=4, unique=True))
            cu_seqlens = tuple([0] + sorted(b for b in inner if 0 < b < seq_len) + [seq_len])
        return AttentionProblem(P, seq_len, kv_heads * group, kv_heads, dim, draw(st.sampled_from(choices)), causal,
                                window, cu_seqlens, None if batch is None else draw(st.integers(1, batch)))

    return problems()
