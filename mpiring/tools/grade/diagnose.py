"""What a wrong output is likely to be: hints from the numbers alone (list of (kind, text)).

Forward: rows or heads put back in the wrong place (after an all-to-all), grouped-query heads
mapped with ``np.tile`` instead of ``np.repeat``, then ``mpiring.testing.diagnose_forward``: NaN,
the wrong softmax scale, a block skipped, taken in full or masked wrongly, or blocks merged with
the wrong weights. Backward: dK/dV on the wrong rank or never sent round. Merge: out averaged or
summed, lse as max or sum, overflow.
"""

import numpy as np

from ... import testing
from ...testing.locate import diagnose_forward

__all__ = ["diagnose_backward", "diagnose_forward", "diagnose_layout", "diagnose_merge"]


def _close(a, b, tol):
    return testing.attention_error(a, b)[0] <= max(100 * tol, 1e-9)


def diagnose_layout(got, ref, Q, K, V, idx, positions, causal, tol, rank, group=1):
    """Hints for a wrong forward output of this rank's rows ``idx`` (Q, K, V: the whole sequence)."""
    got = np.asarray(got, dtype=np.float64)
    q = Q[..., idx, :]
    if np.all(np.isfinite(got)):
        for s, rows in enumerate(positions):
            if s != rank and len(rows) == len(idx) and _close(got, testing.reference(
                    Q[..., rows, :], K, V, causal=causal, q_positions=rows)[0], tol):
                return [("rows", f"rank {rank} returned the output of rank {s}'s queries (global positions "
                                 f"{rows[0]}..{rows[-1]}): send each part back to the rank it came from")]
        H = got.shape[-3]
        order = [next((j for j in range(H) if _close(got[..., h, :, :], ref[..., j, :, :], tol)), None)
                 for h in range(H)]
        if H > 1 and None not in order and order != list(range(H)):
            moved = "; ".join(f"head {h} holds head {j}" for h, j in enumerate(order) if h != j)
            return [("heads", f"rank {rank}'s output has its heads in the wrong order ({moved}): after the "
                              f"all-to-all back, rank s's heads go to positions s*H/P..(s+1)*H/P-1")]
        Hk = K.shape[-3]
        if Hk < H:
            tiled = [h % Hk for h in range(H)]
            alt, _ = testing.reference(q, np.take(K, tiled, -3), np.take(V, tiled, -3), causal=causal,
                                       q_positions=idx)
            if _close(got, alt, tol):
                return [("gqa", f"query head h uses K/V head h // {H // Hk} (np.repeat(k, {H // Hk}, axis=-3)); "
                                f"yours uses K/V head h % {Hk} (np.tile)")]
    return diagnose_forward(got, ref, q, K, V, idx, positions, causal, tol, rank)


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
