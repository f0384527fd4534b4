"""The support matrix's problems: each cell's tokens, mask, scores and inputs, its float64 reference, and its call.

Every rank builds the whole problem from one seed (``SEED``) and takes its
rows; ``reference`` is the dense float64 result over the whole sequence
(``mpiring.testing``'s). The heads axis' "MLA" runs ``mla_attention`` on a
latent (``LATENT``: r values and a rope key per token, per-head d_nope and
dv) against ``testing.latent_reference``; the mask axis' "top-k" is an indexer's choice
of 2 blocks of 2 tokens per query (``plans.indexer.select`` in one process: the
choice ``select_topk`` gives every rank).
"""

import functools
import math

import numpy as np

from mpiring import testing
from mpiring.core.modifiers import t5_bias
from mpiring.core.precision import named_dtype
from mpiring.core.scores import alibi
from mpiring.plans.indexer import Selected, select
from mpiring.plans.layouts import LAYOUTS, shard_indices
from mpiring.testing import latent_reference, latent_reference_backward

__all__ = ["SEED", "LATENT", "sizes", "head_counts", "mask_options", "placement", "inputs", "score_options",
           "extra_grads", "reference", "call", "grad_names"]

SEED = 20240611
LATENT = dict(r=8, dr=2, d_nope=6, dv=8)  # the MLA cells' widths (q's head dim: d_nope + dr = the cells' 8)


def sizes(P):
    """``(S, dim, query heads)`` of every cell at P ranks: uneven shards, heads that split evenly over P."""
    return 4 * P + 3, 8, 4 * P // math.gcd(4, P)


def head_counts(P, heads):
    """``(query heads, K/V heads)`` of the heads axis' value ``heads`` at P ranks: K/V heads as many as q's, half
    as many, one (MLA: one latent); "uneven": P + P // 2 heads (not divisible by P from 2), and twice as many
    over those in "uneven GQA"."""
    hq, u = sizes(P)[2], P + P // 2
    return {"MHA": (hq, hq), "GQA": (hq, hq // 2), "MQA": (hq, 1), "MLA": (hq, 1), "uneven": (u, u),
            "uneven GQA": (2 * u, u)}[heads]


@functools.lru_cache(maxsize=None)
def _chosen(S):
    """The top-k cells' choice: DSA's indexer (2 heads of 4) on seeded inputs, 2 blocks of 2 tokens per query."""
    rng = np.random.default_rng([SEED, S, 2])
    q, k, w = rng.standard_normal((2, S, 4)), rng.standard_normal((1, S, 4)), rng.random((2, S))
    return Selected(select(q, k, np.arange(S), topk=2, block=2, weights=w), 2)


def mask_options(name, S):
    """The ``ring_attention`` (and ``definition_mask``) options of mask ``name`` over S tokens."""
    if name == "top-k":
        return {"mask": (_chosen(S),)}
    return {"none": {}, "causal": {"causal": True}, "window": {"window": (3, 1)},
            "documents": {"causal": True, "cu_seqlens": np.array([0, S // 3, S // 2 + 1, S])},
            "block-causal": {"causal": True, "causal_block": 3}}[name]


def _partition(rng, items, P):
    """``items`` shuffled and cut into P non-empty, uneven, unsorted parts."""
    cuts = np.sort(rng.choice(np.arange(1, len(items)), P - 1, replace=False))
    return np.split(rng.permutation(items), cuts)


def placement(P, rank, assignment):
    """``(query positions, k/v positions, options)`` of ``rank``: a layout's shard, or positions from a seed."""
    S = sizes(P)[0]
    if assignment in LAYOUTS:
        mine = shard_indices(S, P, rank, assignment)
        return mine, mine, {"layout": assignment}
    rng = np.random.default_rng([SEED, P])
    kv = _partition(rng, np.arange(S), P)
    if assignment == "positions":
        return kv[rank], kv[rank], {"positions": kv[rank]}
    queries = _partition(rng, np.arange(S // 2, S), P)  # chunked prefill: the last tokens against all of them
    return queries[rank], kv[rank], {"positions": queries[rank], "kv_positions": kv[rank]}


@functools.lru_cache(maxsize=None)
def inputs(P, heads, dtype):
    """Whole arrays in ``dtype`` (the same on every rank), and the same as float64: q, k, v, dout, or for "MLA"
    q, c_kv, k_rope, dout and the float64 weights w_uk, w_uv."""
    S, D, hq = sizes(P)
    if heads == "MLA":
        r, dr, d_nope, dv = (LATENT[n] for n in ("r", "dr", "d_nope", "dv"))
        rng = np.random.default_rng([SEED, S, hq, r])
        arrays = [rng.standard_normal((h, S, d)).astype(named_dtype(dtype)) for h, d in ((hq, D), (1, r), (1, dr),
                                                                                         (hq, dv))]
        weights = [rng.standard_normal((hq, r, d)) / math.sqrt(r) for d in (d_nope, dv)]
        return arrays + weights, [a.astype(np.float64) for a in arrays] + weights
    hq, hk = head_counts(P, heads)
    rng = np.random.default_rng([SEED, S, hq, hk])
    arrays = [rng.standard_normal((h, S, D)).astype(named_dtype(dtype)) for h in (hq, hk, hk, hq)]
    return arrays, [a.astype(np.float64) for a in arrays]


def checkerboard(s, batch, head, q_pos, k_pos):
    """The "score_mod" cells' modifier: half the score on a checkerboard of (query, key), plus a head offset."""
    return np.where((q_pos + k_pos) % 2 == 0, 0.5 * s, s) + 0.25 * head


def checkerboard_grad(s, batch, head, q_pos, k_pos):
    return np.where((q_pos + k_pos) % 2 == 0, 0.5, 1.0) + 0.0 * s


def score_options(name, P, heads="MHA"):
    """The ``ring_attention`` options of score modifier ``name`` at P ranks with the heads of ``heads``
    (docs/masks.md)."""
    hq = head_counts(P, heads)[0]
    if name == "table":  # T5's relative position buckets, a table drawn from the cells' seed
        return {"bias": t5_bias(np.random.default_rng([SEED, hq]).standard_normal((hq, 8)), max_distance=16)}
    return {"none": {}, "softcap": {"softcap": 2.0}, "alibi": {"bias": alibi(hq)},
            "sinks": {"sinks": np.linspace(-1.0, 1.0, hq)}, "dropout": {"dropout": 0.25, "seed": 3},
            "score_mod": {"score_mod": checkerboard, "score_mod_grad": checkerboard_grad}}[name]


def extra_grads(score):
    """The names of the gradients a backward returns after dq, dk, dv with score modifier ``score``."""
    return {"sinks": ("dsinks",), "table": ("dtable",)}.get(score, ())


@functools.lru_cache(maxsize=None)
def reference(P, heads, dtype, mask, prefill, score="none"):
    """float64 ``(out, lse, dq, dk, dv[, dsinks or dtable])`` (MLA: ``(out, lse, dq, dc_kv, dk_rope, dw_uk,
    dw_uv)``) over the whole sequence; ``prefill``: only the queries of ``placement``'s kv_positions (the last
    S - S//2) count in the key gradients (dout is zero for the others)."""
    S = sizes(P)[0]
    arrays = inputs(P, heads, dtype)[1]
    pos = np.arange(S)
    dout = np.where(pos[:, None] >= S // 2, arrays[3], 0.0) if prefill else arrays[3]
    if heads == "MLA":  # MLA takes no score modifier: those cells raise
        q, c, kr, _, wk, wv = arrays
        options = mask_options(mask, S)
        return latent_reference(q, c, kr, wk, wv, **options) + latent_reference_backward(dout, q, c, kr, wk, wv,
                                                                                         **options)
    q, k, v, _ = arrays
    options = dict(mask_options(mask, S), **score_options(score, P, heads))
    return testing.reference(q, k, v, **options) + testing.reference_backward(dout, q, k, v, **options)


def call(heads, backward=False):
    """The entry point a cell calls, ``(arrays, comm, options, record, forward result)``: ``ring_attention`` (or
    its backward), ``mla_attention`` for "MLA" (which refuses the options it does not take on every rank)."""
    from mpiring import mla_attention, mla_attention_backward, ring_attention, ring_attention_backward

    if heads != "MLA":
        if backward:
            return lambda a, comm, options, record, result: ring_attention_backward(
                a[3], *a[:3], *result, comm, record=record, **options)
        return lambda a, comm, options, record, result: ring_attention(*a[:3], comm, record=record, **options)
    if backward:
        return lambda a, comm, options, record, result: mla_attention_backward(
            a[3], *a[:3], *a[4:], *result, comm, record=record, **options)
    return lambda a, comm, options, record, result: mla_attention(*a[:3], *a[4:], comm, record=record, **options)


def grad_names(heads):
    """The gradients a cell's backward returns, and whose rows each holds ("q", "k" or "all")."""
    if heads == "MLA":
        return (("dq", "q"), ("dc_kv", "k"), ("dk_rope", "k"), ("dw_uk", "all"), ("dw_uv", "all"))
    return (("dq", "q"), ("dk", "k"), ("dv", "k"))
