"""Verification that scales: every rank makes its own inputs from the seed and checks rows of its own shard.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal --layout zigzag

Token block ``b`` of tensor ``c`` (q, k, v, dout) is drawn from ``default_rng([seed, c, b])``: any rank makes
any token without the others, so no rank holds a whole tensor. The check is an exact float64 computation
from those inputs, the mask from its definition (``core.reference.definition_mask``, never the plan), the
textbook softmax with an online max and sum over key blocks: no code shared with the ring it checks. It
covers out and lse of a sample of each rank's rows, dQ of those rows, and dK, dV of a sample of each rank's
keys when ``seq_len <= DKV_MAX_SEQ`` (they need every row's exact lse: a pass as costly as the forward ring).
"""

import numpy as np

from mpiring.core.reference import definition_mask
from mpiring.plans.layouts import layout_positions, shard_indices
from mpiring.testing import tolerance

__all__ = ["BLOCK", "SAMPLE", "DKV_MAX_SEQ", "TOLERANCE", "run_tolerance", "Inputs", "sample_rows", "check_partition",
           "forward_reference", "dq_reference", "dkv_reference", "check_rank", "Scores", "print_checks"]

BLOCK = 1024  # tokens per seeded block
KINDS = ("q", "k", "v", "dout")
SAMPLE = 256  # rows (and keys) checked per rank at most, unless all rows are computed anyway
DKV_MAX_SEQ = 16384  # dK and dV are checked up to this sequence length
ROW_CHUNK = 256  # query rows per matrix product in the forward pass (bounds its memory)
# accepted error: absolute for out and lse (unit-normal inputs), relative to max(1, max |reference|) for gradients
TOLERANCE = {np.dtype(np.float64): 1e-10, np.dtype(np.float32): 1e-4}


def run_tolerance(dtype, wire=None, codings=1):
    """The error ``run`` accepts for inputs of ``dtype`` with K/V on the ``wire``: TOLERANCE above, half
    inputs and coded wires by the library's one table (``mpiring.testing.TOLERANCE``; ``codings`` as there)."""
    return max(TOLERANCE.get(np.dtype(dtype), 0.0), tolerance(dtype, wire, codings))


class Inputs:
    """The seeded inputs of a run, made one block of ``BLOCK`` tokens at a time."""

    def __init__(self, seed, batch, heads, kv_heads, dim, dtype):
        self.seed, self.batch, self.heads, self.kv_heads, self.dim = seed, batch, heads, kv_heads, dim
        self.dtype = np.dtype(dtype)

    def block(self, kind, b):
        """All ``BLOCK`` tokens of block ``b`` of ``kind``: ``(batch, heads of kind, BLOCK, dim)``, run dtype."""
        heads = self.heads if kind in ("q", "dout") else self.kv_heads
        rng = np.random.default_rng([self.seed, KINDS.index(kind), b])
        return rng.standard_normal((self.batch, heads, BLOCK, self.dim)).astype(self.dtype)

    def tokens(self, kind, positions):
        """The tokens at sorted global ``positions``: ``(batch, heads, len(positions), dim)``, run dtype."""
        positions = np.asarray(positions, np.int64)
        parts = []
        for b in np.unique(positions // BLOCK):
            inside = positions[(positions >= b * BLOCK) & (positions < (b + 1) * BLOCK)]
            parts.append(self.block(kind, int(b))[..., inside - b * BLOCK, :])
        if not parts:
            heads = self.heads if kind in ("q", "dout") else self.kv_heads
            return np.empty((self.batch, heads, 0, self.dim), self.dtype)
        return np.concatenate(parts, axis=-2)

    def blocks(self, kinds, seq_len):
        """``(start, stop, arrays)`` over the sequence, one block at a time, the arrays in float64."""
        for b in range((seq_len + BLOCK - 1) // BLOCK):
            start, stop = b * BLOCK, min(seq_len, (b + 1) * BLOCK)
            yield start, stop, [self.block(kind, b)[..., :stop - start, :].astype(np.float64) for kind in kinds]


def sample_rows(n, seed, rank, what):
    """Local indices of the rows (or keys) to check: all when ``n <= SAMPLE``, else a seeded sample of SAMPLE."""
    if n <= SAMPLE:
        return np.arange(n)
    rng = np.random.default_rng([seed, len(KINDS) + ("rows", "keys").index(what), rank])
    return np.sort(rng.choice(n, SAMPLE, replace=False))


def check_partition(seq_len, size, layout):
    """None if the ranks' shards together hold every position exactly once, else what is wrong."""
    held = np.concatenate([shard_indices(seq_len, size, r, layout) for r in range(size)])
    if not np.array_equal(np.sort(held), np.arange(seq_len)):
        return f"the {layout} shards of {seq_len} tokens over {size} ranks do not hold every position once"
    return None


def _grouped(x, kv_heads):
    """(B, H, n, d) -> (B, Hk, g, n, d): query head h uses K/V head h // g."""
    b, h, n, d = x.shape
    return x.reshape(b, kv_heads, h // kv_heads, n, d)


def _t(k):
    """K/V (B, Hk, n, d) as the right-hand side of a grouped product: (B, Hk, 1, d, n)."""
    return np.swapaxes(k, -1, -2)[:, :, None]


class Scores:
    """The score options a run checks (``--softcap``, ``--sinks``, ``--dropout``), written from their definitions:
    logit r -> softcap * tanh(r / softcap); dropout keeps what ``core.scores.dropout_keep`` draws (the one
    definition of the dropped entries), scaled by 1 / (1 - p); a sink is one more logit per head in every row's
    denominator. No score: every method is the identity."""

    def __init__(self, softcap=None, sinks=None, dropout=0.0, seed=0):
        self.softcap, self.dropout, self.seed = softcap, dropout, seed
        self.sinks = None if sinks is None else np.asarray(sinks, np.float64)

    def logits(self, s):
        """``(s, t)``: the modified logits and tanh(r / softcap) (None without a softcap)."""
        if self.softcap is None:
            return s, None
        t = np.tanh(s / self.softcap)
        return self.softcap * t, t

    def keep(self, p, rows, keys):
        """``p`` with the dropped entries zeroed and the kept ones scaled (grouped (B, Hk, g, n, m))."""
        if not self.dropout:
            return p
        from mpiring.core.scores import dropout_keep
        b, hk, g = p.shape[:3]
        keep = dropout_keep(self.seed, self.dropout, b, np.arange(hk * g), rows, keys).reshape(p.shape)
        return p * keep / (1.0 - self.dropout)

    def sink_logits(self, shape):
        """The sinks grouped as the rows' lse (B, Hk, g, n), or None."""
        return None if self.sinks is None else np.broadcast_to(self.sinks.reshape(shape[1], shape[2], 1), shape)


PLAIN = Scores()


def forward_reference(inputs, rows, seq_len, scale, mask, scores=PLAIN):
    """Exact ``(out, lse)`` in float64 of the query rows at sorted global positions ``rows``.

    Streams over the keys a block at a time, keeping for each row the running
    max ``m`` of its visible scores, the sum ``l`` of ``exp(score - m)`` and the
    weighted sum of values ``acc``; rescales both when the max grows. Rows that
    see no key get out 0 and lse -inf. ``mask``: the keyword arguments of
    ``definition_mask``.
    """
    rows = np.asarray(rows, np.int64)
    q = _grouped(inputs.tokens("q", rows).astype(np.float64), inputs.kv_heads)
    m = np.full(q.shape[:-1], -np.inf)
    l = np.zeros(q.shape[:-1])  # noqa: E741 (the name the textbook gives it)
    acc = np.zeros(q.shape)
    for start, stop, (k, v) in inputs.blocks(("k", "v"), seq_len):
        allowed = definition_mask(rows, np.arange(start, stop), **mask)
        for a in range(0, len(rows), ROW_CHUNK):
            b = min(a + ROW_CHUNK, len(rows))
            if not allowed[a:b].any():
                continue  # no row of this chunk sees a key of this block
            s = np.where(allowed[a:b], scores.logits(q[..., a:b, :] @ _t(k) * scale)[0], -np.inf)
            new_m = np.maximum(m[..., a:b], s.max(axis=-1))
            base = np.where(np.isfinite(new_m), new_m, 0.0)  # a row that has seen nothing yet stays at 0
            p = np.exp(s - base[..., None])
            rescale = np.exp(m[..., a:b] - base)
            l[..., a:b] = l[..., a:b] * rescale + p.sum(axis=-1)
            kept = scores.keep(p, rows[a:b], np.arange(start, stop))
            acc[..., a:b, :] = acc[..., a:b, :] * rescale[..., None] + kept @ v[:, :, None]
            m[..., a:b] = new_m
    sink = scores.sink_logits(l.shape)
    if sink is not None:  # the sink's term exp(sink - m) joins each row's sum (m raised to it where larger)
        new_m = np.maximum(m, sink)
        rescale = np.exp(m - new_m)
        l, acc, m = l * rescale + np.exp(sink - new_m), acc * rescale[..., None], new_m  # noqa: E741
    seen = l > 0
    out = np.where(seen[..., None], acc / np.where(seen, l, 1.0)[..., None], 0.0)
    lse = np.where(seen, m + np.log(np.where(seen, l, 1.0)), -np.inf)
    shape = (q.shape[0], q.shape[1] * q.shape[2], len(rows))
    return out.reshape(shape + (q.shape[-1],)), lse.reshape(shape)


def _probabilities(s, allowed, lse):
    """softmax probabilities from scores and exact per-row lse; 0 where masked or the row sees nothing."""
    finite = np.isfinite(lse)
    p = np.exp(s - np.where(finite, lse, 0.0)[..., None])
    return np.where(allowed & finite[..., None], p, 0.0)


def _score_grads(p, dp, delta, t, scores, rows, keys):
    """dS of the raw logits: p * (keep(dp) - delta), times the softcap's derivative 1 - t^2."""
    ds = p * (scores.keep(dp, rows, keys) - delta[..., None])
    return ds if t is None else ds * (1 - t * t)


def dq_reference(inputs, rows, seq_len, scale, mask, out, lse, scores=PLAIN):
    """Exact dQ in float64 of the query rows ``rows``, given their exact ``out`` and ``lse``.

    dq_i = scale * sum_j p_ij (dout_i . v_j - delta_i) k_j, delta_i = dout_i . out_i.
    """
    rows = np.asarray(rows, np.int64)
    kh = inputs.kv_heads
    q = _grouped(inputs.tokens("q", rows).astype(np.float64), kh)
    dout = _grouped(inputs.tokens("dout", rows).astype(np.float64), kh)
    lse, delta = _grouped(lse[..., None], kh)[..., 0], np.sum(dout * _grouped(out, kh), axis=-1)
    dq = np.zeros(q.shape)
    for start, stop, (k, v) in inputs.blocks(("k", "v"), seq_len):
        allowed = definition_mask(rows, np.arange(start, stop), **mask)
        if not allowed.any():
            continue
        logits, t = scores.logits(q @ _t(k) * scale)
        p = _probabilities(np.where(allowed, logits, -np.inf), allowed, lse)
        ds = _score_grads(p, dout @ _t(v), delta, t, scores, rows, np.arange(start, stop))
        dq += ds @ k[:, :, None] * scale
    return dq.reshape(dq.shape[0], -1, len(rows), dq.shape[-1])


def dkv_reference(inputs, keys, seq_len, scale, mask, lse, delta, scores=PLAIN):
    """Exact ``(dK, dV)`` in float64 of the keys at sorted positions ``keys``, from every query row.

    ``lse`` and ``delta`` (``(B, H, seq_len)``) are every row's exact lse and
    ``dout_i . out_i``. dv_j = sum_i p_ij dout_i; dk_j = scale * sum_i ds_ij q_i,
    summed over the query heads of each K/V head. Streams over query blocks.
    """
    keys = np.asarray(keys, np.int64)
    kh = inputs.kv_heads
    k = inputs.tokens("k", keys).astype(np.float64)
    v = inputs.tokens("v", keys).astype(np.float64)
    dk, dv = np.zeros(k.shape), np.zeros(v.shape)
    for start, stop, (q, dout) in inputs.blocks(("q", "dout"), seq_len):
        allowed = definition_mask(np.arange(start, stop), keys, **mask)
        if not allowed.any():
            continue
        q, dout = _grouped(q, kh), _grouped(dout, kh)
        rows_lse = _grouped(lse[..., start:stop, None], kh)[..., 0]
        rows_delta = _grouped(delta[..., start:stop, None], kh)[..., 0]
        logits, t = scores.logits(q @ _t(k) * scale)
        p = _probabilities(np.where(allowed, logits, -np.inf), allowed, rows_lse)
        rows = np.arange(start, stop)
        dv += (np.swapaxes(scores.keep(p, rows, keys), -1, -2) @ dout).sum(axis=2)
        ds = _score_grads(p, dout @ _t(v), rows_delta, t, scores, rows, keys)
        dk += (np.swapaxes(ds, -1, -2) @ q).sum(axis=2) * scale
    return dk, dv


def _error(got, want, reduce=np.max):
    """Largest (or with ``reduce=np.mean``, mean) |got - want|; 0 where both are the same infinity (lse of a row
    that sees nothing)."""
    got = np.asarray(got, np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    err = np.where(same, 0.0, np.abs(got - want))
    return float(reduce(err)) if err.size else 0.0


def check_rank(inputs, seq_len, size, rank, layout, mask, got, share=None, shards=None, scores=PLAIN):
    """This rank's check: ``{"rows", "of", "keys", "error": {name: err}, "largest": {name: max |ref|}}``.

    ``got``: this rank's ``out`` and ``lse`` (and ``dq``, ``dk``, ``dv`` after a
    backward pass), its shard of the ``layout`` in sequence order; ``layout``
    may also be every rank's sorted positions (``mpiring.balance``).
    ``share(piece)``: every rank's ``piece`` (an all-gather), needed (and called,
    collectively) only when dK and dV are checked. ``shards``: every rank's
    positions, where they do not follow ``layout`` (ring x Ulysses: the grid's).
    ``scores``: the run's ``Scores`` (with sinks, ``got["dsinks"]`` is checked with dK and dV).
    """
    scale = 1.0 / np.sqrt(inputs.dim)
    seed = inputs.seed
    parts = layout_positions(seq_len, size, layout) if isinstance(layout, str) else layout
    positions = parts[rank]
    n = len(positions)
    backward = "dq" in got
    with_dkv = backward and seq_len <= DKV_MAX_SEQ
    rows = np.arange(n) if with_dkv else sample_rows(n, seed, rank, "rows")
    out, lse = forward_reference(inputs, positions[rows], seq_len, scale, mask, scores)
    result = {"rows": len(rows), "of": n, "keys": 0, "error": {}, "mean": {}, "largest": {}}

    def compare(name, mine, ref):
        result["error"][name] = _error(mine, ref)
        result["mean"][name] = _error(mine, ref, np.mean)
        result["largest"][name] = float(np.max(np.abs(ref), initial=0.0, where=np.isfinite(ref)))

    compare("out", got["out"][..., rows, :], out)
    compare("lse", got["lse"][..., rows], lse)
    if not backward:
        return result
    sampled = rows if not with_dkv else sample_rows(n, seed, rank, "rows")
    compare("dQ", got["dq"][..., sampled, :],
            dq_reference(inputs, positions[sampled], seq_len, scale, mask, out[..., sampled, :], lse[..., sampled],
                         scores))
    result["dq_rows"] = len(sampled)
    if not with_dkv:
        return result
    # every row's exact lse and delta: each rank has its own rows' (all of them, above); share them out
    delta = np.sum(inputs.tokens("dout", positions).astype(np.float64) * out, axis=-1)
    pieces = share(np.ascontiguousarray(np.stack([lse, delta])))
    every = np.empty((2,) + lse.shape[:-1] + (seq_len,))
    for r, piece in enumerate(pieces):
        every[..., parts[r]] = piece
    keys = sample_rows(n, seed, rank, "keys")
    dk, dv = dkv_reference(inputs, positions[keys], seq_len, scale, mask, every[0], every[1], scores)
    compare("dK", got["dk"][..., keys, :], dk)
    compare("dV", got["dv"][..., keys, :], dv)
    if scores.sinks is not None:  # d loss / d sink_h = -sum over every row of p_sink * delta
        compare("dsinks", got["dsinks"], -np.sum(np.exp(scores.sinks[:, None] - every[0]) * every[1], axis=(0, 2)))
    result["keys"] = len(keys)
    return result


NAMES = ("out", "lse", "dQ", "dK", "dV", "dsinks")  # what a check may compare, in report order
GRADIENTS = ("dQ", "dK", "dV", "dsinks")  # compared relative to max(1, max |reference|)


def print_checks(checks, dtype, wire=None):
    """The table of what every rank checked, and the largest errors; a line for each error beyond tolerance.

    [] when nothing was compared (--no-verify).
    """
    if checks is None:
        return []
    tol = run_tolerance(dtype, wire)
    names = [n for n in NAMES if n in checks[0]["error"]]
    print("\nverification: every rank recomputed rows of its own shard exactly (float64, from the seeded "
          "inputs; mask from its definition)")
    head = "rank  query rows checked" + ("  dQ rows  keys (dK, dV)" if "dQ" in names else "")
    print(head + "".join(f"  {n + ' error':>10}" for n in names))
    for r, c in enumerate(checks):
        rows = f"{c['rows']} of {c['of']}"
        line = f"{r:>4}  {rows:>18}"
        if "dQ" in names:
            line += f"  {c['dq_rows']:>7}  {c['keys'] or '-':>13}"
        print(line + "".join(f"  {c['error'][n]:>10.3e}" for n in names))
    failed = []
    relative = "; gradients relative to max(1, max |reference|)" if "dQ" in names else ""
    print(f"largest error over all ranks (tolerance {tol:g}{relative}):")
    for n in names:
        worst = max(range(len(checks)), key=lambda r: checks[r]["error"][n])
        err = checks[worst]["error"][n]
        largest = max(c["largest"][n] for c in checks)
        rel = err / max(1.0, largest) if n in GRADIENTS else err
        if not rel <= tol:
            failed.append(f"{n}: error {rel:.3e} on rank {worst} exceeds the tolerance {tol:g}")
        extra = f" relative, max |reference| {largest:.3g}" if n in GRADIENTS else " absolute"
        mean = sum(c["mean"][n] for c in checks) / len(checks)  # the ranks' mean errors, averaged
        print(f"  {n:>3} {rel:.3e}{extra}; mean {mean:.3e} absolute")
    if "dQ" in names and "dK" not in names:
        print(f"  dK, dV not checked: seq_len > {DKV_MAX_SEQ} (they need every row's exact lse, "
              f"a pass as costly as the forward ring)")
    return failed
