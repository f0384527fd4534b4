"""Which K/V block a wrong output got wrong, and the assertion that says so for a sharded attention.

``diagnose_forward`` tries the ways each rank's K/V block could have been taken (skipped, in full,
with the triangle of ``np.tril``, with the causal mask of global positions) against the exact
per-block attentions, and recognises blocks merged with the wrong weights, the wrong softmax scale
and NaN. ``assert_sharded_attention`` computes the reference of this rank's shard, compares, adds
those hints, and reaches one verdict on every rank.
"""

import itertools
import math

import numpy as np

from ..plans.layouts import shard_indices
from .compare import DEFAULT_ASSERT_TIMEOUT, assert_attention_close, assert_on_all_ranks, attention_error
from .expected import dense_mask, reference, tolerance

__all__ = ["STATE_TEXT", "assert_sharded_attention", "diagnose_forward"]

STATE_TEXT = {"none": "skipped", "full": "attended in full",
              "tri": "masked with the causal triangle (np.tril of the block)",
              "causal": "attended with the causal mask j <= i of global positions"}


def _merge_blocks(parts, shape):
    """Exact log-sum-exp merge of block (out, lse) pairs; rows no block sees get 0."""
    if not parts:
        return np.zeros(shape)
    outs = np.stack([o for o, _ in parts])
    lses = np.stack([lse for _, lse in parts])
    m = lses.max(axis=0)
    m = np.where(np.isfinite(m), m, 0.0)
    w = np.exp(lses - m)
    total = w.sum(axis=0)
    return (w[..., None] * outs).sum(axis=0) / np.where(total > 0, total, 1.0)[..., None]


def _block_states(q, K, V, idx, positions, causal):
    """Per source rank s: ({state: (out, lse) or None}, true state) for the ways its block could be masked.

    States: skipped, in full, with the triangle of local offsets (what np.tril gives: the right mask
    for a rank's own block), and with the exact causal mask of global positions when that is
    none of these (e.g. the half-visible off-diagonal blocks of zigzag shards).
    """
    blocks = []
    for ks in positions:
        k, v = K[..., ks, :], V[..., ks, :]
        mask = dense_mask(idx, ks, causal=True)
        local = dense_mask(np.arange(len(idx)), np.arange(len(ks)), causal=True)
        states = {"none": None, "full": reference(q, k, v, q_positions=idx, k_positions=ks)}
        if local.any() and not local.all():
            states["tri"] = reference(q, k, v, causal=True)
        if mask.any() and not mask.all() and not np.array_equal(mask, local):
            states["causal"] = reference(q, k, v, causal=True, q_positions=idx, k_positions=ks)
        if not causal or mask.all():
            truth = "full"
        elif not mask.any():
            truth = "none"
        else:
            truth = "tri" if np.array_equal(mask, local) else "causal"
        blocks.append((states, truth))
    return blocks


def diagnose_forward(got, ref, q, K, V, idx, positions, causal, tol, rank):
    """Hints for a wrong forward output, from the numbers alone (list of (kind, text))."""
    got = np.asarray(got, dtype=np.float64)
    bad = ~np.isfinite(got)
    if bad.any():
        h, i = (int(x) for x in np.argwhere(bad)[0][:2])
        return [("nan", (f"{int(bad.sum())} NaN/Inf values (the first in head {h}, row {i}): a block with no "
                        f"visible key has lse = -inf, and exp(-inf - (-inf)) is NaN; skip blocks a row cannot see, "
                        f"or guard the merge when both lse are -inf"))]
    match = max(100 * tol, 1e-9)
    hints = []
    d = q.shape[-1]
    for scale, name in ((1.0, "1"), (1.0 / d, "1/D")):
        alt, _ = reference(q, K, V, causal=causal, q_positions=idx, scale=scale)
        if attention_error(got, alt)[0] <= match:
            hints.append(("scale", f"your output is attention with softmax scale {name}; the scale is 1/sqrt(D)"))
    if hints:
        return hints
    blocks = _block_states(q, K, V, idx, positions, causal)
    truth = [t for _, t in blocks]
    options = [list(states) for states, _ in blocks]
    if math.prod(len(o) for o in options) <= 4096:
        combos = itertools.product(*options)
    else:  # many ranks: combinations that differ from the truth in one or two blocks
        combos = [tuple(truth[:a]) + (x,) + tuple(truth[a + 1:]) for a, o in enumerate(options) for x in o]
    best = (np.inf, None)
    for combo in combos:
        if list(combo) == truth:
            continue
        parts = [blocks[s][0][state] for s, state in enumerate(combo) if state != "none"]
        err = float(np.max(np.abs(got - _merge_blocks(parts, got.shape)), initial=0.0))
        if err < best[0]:
            best = (err, combo)
    if best[0] <= match:
        combo = best[1]
        diffs = [f"rank {s}'s K/V block is {STATE_TEXT[c]} (it must be {STATE_TEXT[t]})"
                 for s, (c, t) in enumerate(zip(combo, truth)) if c != t]
        if causal:
            advice = ("causal mask off by one block? With contiguous shards rank r sees the block of rank s in full "
                  "when s < r, with the triangle when s == r, and not at all when s > r")
        elif all(c == "none" for c, t in zip(combo, truth) if c != t):
            advice = "does your loop attend to all P blocks, its own and the P - 1 it receives?"
        else:
            advice = "only the causal case masks anything"
        return [("mask", f"rank {rank}'s output is exactly attention in which " + "; ".join(diffs) + f": {advice}")]
    visible = [(s, blocks[s][0][t]) for s, t in enumerate(truth) if t != "none"]
    if 1 <= len(visible) < d:
        hint = _span_hint(got, ref, visible, tol, rank)
        if hint:
            return [hint]
    rows = np.nonzero(np.max(np.abs(got - ref), axis=tuple(a for a in range(got.ndim) if a != got.ndim - 2))
                      > tol)[0]
    n = got.shape[-2]
    where = (f"rows {rows[0]}..{rows[-1]} of its {n}, global positions {idx[rows[0]]}..{idx[rows[-1]]}"
             if len(rows) else "no row")
    text = f"rank {rank}: the error is in {len(rows)} of {n} rows ({where})"
    if causal:
        text += "; causal mask off by one block or one token? query i sees key j only when j <= i (global positions)"
    return [("other", text)]


def _span_hint(got, ref, visible, tol, rank):
    """If every row is some mix of the per-block outputs, the blocks were merged with the wrong weights."""
    outs = np.stack([o for _, (o, _) in visible], axis=-2)  # (..., n, m, D)
    lses = np.stack([lse for _, (_, lse) in visible], axis=-1)  # (..., n, m)
    a = outs.reshape((-1,) + outs.shape[-2:])
    x = got.reshape(-1, got.shape[-1])
    w = np.einsum("bd,bdm->bm", x, np.linalg.pinv(a))
    residual = np.linalg.norm(x - np.einsum("bm,bmd->bd", w, a), axis=-1)
    scale = np.maximum(np.linalg.norm(x, axis=-1), 1e-300)
    if np.max(residual / scale) > max(1e3 * tol, 1e-6):
        return None
    err = np.max(np.abs(got - ref), axis=-1).reshape(-1)
    row = int(np.argmax(err))
    lse = lses.reshape(-1, lses.shape[-1])[row]
    right = np.exp(lse - np.max(lse))
    right /= right.sum()
    names = [f"O{s}" for s, _ in visible]
    yours = " + ".join(f"{c:.2f} {nm}" for c, nm in zip(w[row], names))
    rule = " + ".join(f"{c:.2f} {nm}" for c, nm in zip(right, names))
    n_rows = got.shape[-2]
    text = (f"did you rescale with the log-sum-exp when merging? Rank {rank}, row {row % n_rows} (head "
            f"{row // n_rows}): your output is {yours}, where Os is the attention to rank s's K/V block alone; "
            f"the log-sum-exp rule gives {rule} (out = sum_s exp(lse_s - lse) Os, lse = log sum_s exp(lse_s))")
    factor = w[row] / np.where(right > 0, right, np.nan)
    if np.nanmax(factor) - np.nanmin(factor) < 1e-6 * max(1.0, abs(np.nanmax(factor))):
        text += f"; the row is off by a factor {np.nanmax(factor):.3g}"
    return ("merge", text)


def assert_sharded_attention(out, q, K, V, comm, *, dtype=None, causal=False, layout="contiguous", shard="sequence",
                             timeout=DEFAULT_ASSERT_TIMEOUT):
    """Check this rank's result of a distributed attention against the reference; one verdict on every rank.

    ``K``, ``V``: the whole sequence's keys and values (..., Hk, S, D), the same on every rank.
    ``shard="sequence"``: ``q`` and ``out`` are this rank's rows (``shard_indices(S, P, rank, layout)``),
    all heads; a failure names the rank, global position and head, and which K/V block was skipped,
    taken in full, masked wrongly or merged with the wrong weights. ``shard="heads"``: ``q`` and
    ``out`` are this rank's heads (``head_indices(H, P, rank)`` of the query heads; every rank
    holds H/P of them and of the K/V heads), all positions. ``dtype``: what the computation ran in
    (default out's). Rank 0's AssertionError summarises every failing rank. Returns this rank's error.
    """
    P, rank = comm.Get_size(), comm.Get_rank()
    dtype = np.asarray(out).dtype if dtype is None else dtype
    S = np.shape(K)[-2]
    hints, heads = [], None
    if shard == "sequence":
        positions = [shard_indices(S, P, r, layout) for r in range(P)]
        rows = positions[rank]
        ref, _ = reference(q, K, V, causal=causal, q_positions=rows)
        if np.shape(out) == ref.shape and attention_error(out, ref)[0] > tolerance(dtype):
            hints = [text for _, text in diagnose_forward(out, ref, q, K, V, rows, positions, causal,
                                                          tolerance(dtype), rank)]
    elif shard == "heads":
        from .problems import head_indices

        H, Hk = np.shape(q)[-3] * P, np.shape(K)[-3]
        heads, kv = head_indices(H, P, rank), head_indices(Hk, P, rank)
        rows = None
        ref, _ = reference(q, np.take(K, kv, axis=-3), np.take(V, kv, axis=-3), causal=causal)
    else:
        raise ValueError(f"shard must be 'sequence' or 'heads', not {shard!r}")
    if np.shape(out) != ref.shape:
        assert_on_all_ranks(comm, f"out: rank {rank} returned shape {np.shape(out)}, expected {ref.shape}", "out",
                            timeout)
        return None
    return assert_attention_close(out, ref, dtype, positions=rows, heads=heads, comm=comm, hints=hints,
                                  timeout=timeout)
