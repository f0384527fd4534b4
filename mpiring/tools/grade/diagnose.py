"""What a wrong output is likely to be: hints from the numbers alone (list of (kind, text)).

Forward: NaN, the wrong softmax scale, a block skipped, taken in full or masked wrongly (tried
against exact per-block attentions), or blocks merged with the wrong weights. Backward: dK/dV on
the wrong rank or never sent round. Merge: out averaged or summed, lse as max or sum, overflow.
"""

import itertools
import math

import numpy as np

from ... import testing

__all__ = ["STATE_TEXT", "diagnose_backward", "diagnose_forward", "diagnose_merge"]


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
        mask = testing.dense_mask(idx, ks, causal=True)
        local = testing.dense_mask(np.arange(len(idx)), np.arange(len(ks)), causal=True)
        states = {"none": None, "full": testing.reference(q, k, v, q_positions=idx, k_positions=ks)}
        if local.any() and not local.all():
            states["tri"] = testing.reference(q, k, v, causal=True)
        if mask.any() and not mask.all() and not np.array_equal(mask, local):
            states["causal"] = testing.reference(q, k, v, causal=True, q_positions=idx, k_positions=ks)
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
        alt, _ = testing.reference(q, K, V, causal=causal, q_positions=idx, scale=scale)
        if testing.attention_error(got, alt)[0] <= match:
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
    where = f"rows {rows[0]}..{rows[-1]} of its {n}" if len(rows) else "no row"
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


def diagnose_backward(got, refs, errors, tol, dk_all, dv_all, dk_part, dv_part, positions, idx, rank):
    hints = []
    _, dk, dv = got
    if errors["dk"][0] > tol or errors["dv"][0] > tol:
        for s, ks in enumerate(positions):
            if s != rank and len(ks) == len(idx) and testing.attention_error(dk, dk_all[..., ks, :], "dk")[0] <= tol \
                    and testing.attention_error(dv, dv_all[..., ks, :], "dv")[0] <= tol:
                hints.append(("home", (f"rank {rank} holds the dK/dV of rank {s}'s keys: the partial gradients "
                                      f"must travel (s - r) mod P = {(s - rank) % len(positions)} hops fewer/more "
                                      f"to end on their owner")))
                break
        else:
            if testing.attention_error(dk, dk_part[..., idx, :], "dk")[0] <= tol:
                hints.append(("partial", (f"rank {rank}'s dK/dV hold only its own queries' contributions: a K/V "
                                         f"block's partial dK/dV must travel with it and come home to its owner")))
    if errors["dq"][0] > tol:
        hints.append(("dq", ("dq wrong: recompute P = exp(scale q k^T - lse) from the lse you are given, "
                            "dS = P * (dout v^T - rowsum(dout * out)), dq = scale dS k summed over all blocks")))
    return hints


def diagnose_merge(got, ref_out, ref_lse, parts, tol, causal, scale):
    out, lse = (np.asarray(x, dtype=np.float64) for x in got)
    (o1, l1), (o2, l2) = parts
    if not np.all(np.isfinite(out)) or np.any(np.isnan(lse)) or not np.all(np.isfinite(lse[np.isfinite(ref_lse)])):
        if causal:
            return [("nan", ("NaN: an empty block has lse = -inf; with m = max(lse1, lse2), exp(-inf - m) = 0 is "
                            "fine but exp(-inf - (-inf)) is NaN: a row both blocks miss must give out 0, lse -inf"))]
        if scale > 1:
            return [("overflow", ("Inf/NaN with large scores: exp(lse) overflows; subtract m = max(lse1, lse2) "
                                 "first: lse = m + log(exp(lse1 - m) + exp(lse2 - m))"))]
        return [("nan", "NaN/Inf in the result")]
    hints = []
    close = testing.attention_error
    wrong_out = [text for cand, text in (((o1 + o2) / 2, "the mean of the two outputs"),
                                         (o1 + o2, "the sum of the two outputs"), (o2, "the second output alone"),
                                         (o1, "the first output alone")) if close(out, cand)[0] <= 100 * tol]
    if wrong_out:
        hints.append(("merge", (f"out is {wrong_out[0]}: did you rescale with the log-sum-exp? out = "
                               f"exp(lse1 - lse) out1 + exp(lse2 - lse) out2")))
    elif close(out, ref_out)[0] > tol:
        hints.append(("merge", "out: weight each block by exp(lse_b - lse), with lse the merged log-sum-exp"))
    wrong_lse = [text for cand, text in ((np.maximum(l1, l2), "max(lse1, lse2)"), (l1 + l2, "lse1 + lse2"))
                 if close(lse, cand)[0] <= 100 * tol]
    if wrong_lse:
        hints.append(("lse", (f"lse is {wrong_lse[0]}; it is log(exp(lse1) + exp(lse2)) = "
                             f"m + log(exp(lse1 - m) + exp(lse2 - m))")))
    return hints
