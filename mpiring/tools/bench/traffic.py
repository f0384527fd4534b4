"""Bytes moved, measured against the models: a zoo of masks under each movement, top-k chosen by an indexer, and
MLA's latent. Each command exits 1 if a rank's recorded bytes differ from its model.

    mpiexec -n 8 python -m mpiring bench zoo --markdown      # the rows of docs/balance.md section 7 at P = 8
    mpiexec -n 4 python -m mpiring bench topk                 # the top-k table at P = 4 (docs/masks.md)
    mpiexec -n 4 python -m mpiring bench latent --markdown    # the latent table, as docs/training.md holds it

``zoo``: every mask of ``zoo_masks`` (``TOKENS`` tokens per rank), contiguous and zigzag, forward and backward
under each movement (``MOVEMENTS``), bytes summed over the ranks beside the minimum (every other rank's block
its queries see, once, from the masks' definition), against ``nodes.predicted_bytes``. ``topk``: DSA's
indexer (``select_topk``), then causal attention under its choice with the sparse movement and the dense ring,
against ``nodes.predicted_bytes`` and ``select_topk``'s formula. ``latent``: the ring moving MLA's latent
(``mla_attention``) and the per-head K/V under the same plan, bytes per token against ``core.mla``'s formulas.
"""

import functools

import numpy as np

from mpiring import (
    Record,
    mla_attention,
    mla_attention_backward,
    ring_attention,
    ring_attention_backward,
    select_topk,
    shard_indices,
)
from mpiring.core.mla import expand, latent_bytes, per_head_bytes
from mpiring.core.reference import definition_mask
from mpiring.cost.by_strategy import kv_tokens_sent
from mpiring.cost.nodes import predicted_bytes

from ..cli import Agreed, command_parser, table_text

__all__ = ["TOKENS", "ZOO_SHAPE", "MOVEMENTS", "TOPK_ROWS", "TOPK_SHAPE", "LATENT_SHAPES", "zoo_masks",
           "minimum_bytes", "measured_bytes", "zoo_rows", "topk_rows", "latent_rows", "zoo_table", "topk_table",
           "latent_table", "zoo", "topk", "latent", "zoo_parser", "topk_parser", "latent_parser"]

TOKENS = 16  # tokens per rank (zoo, latent)
ZOO_SHAPE = dict(batch=1, hq=2, hk=1, dim=8, dim_v=8, itemsize=4)  # float32: 64 bytes of K and V per token
MOVEMENTS = {"sparse": "sparse", "ring": "ring", "all-gather": "allgather"}  # column -> mode
LAYOUTS = ("contiguous", "zigzag")
# (tokens per rank, blocks kept, indexer inputs): "random", or "local" (keys near the query score higher)
TOPK_ROWS = [(n, k, inputs) for inputs in ("random", "local") for n in (64, 256) for k in (1, 2, 4)]
BLOCK, INDEX = 16, dict(heads=4, dim=32)  # tokens per block; DSA's indexer heads and their dim
FREQUENCIES = np.pi / (BLOCK * 2.0 ** np.arange(6))  # "local": cos(w (t - s)) summed over these, amplitude 2
TOPK_SHAPE = dict(batch=1, hq=4, hk=1, dim=64, dim_v=64, itemsize=4)  # float32: 512 bytes of K and V per token
LATENT_SHAPES = {"DeepSeek-V3": dict(heads=128, d_nope=128, dr=64, dv=128, r=512),
                 "small": dict(heads=8, d_nope=32, dr=16, dv=32, r=64)}


def _sum(comm, value):
    return comm.allreduce(int(value))


def zoo_masks(S):
    """Name -> ``ring_attention`` mask options over S tokens (S = TOKENS * P)."""
    n = S // 16  # a sixteenth of the sequence: a shard at P = 16, two shards at P = 8, ...

    def docs(*cuts):
        return np.array(sorted({0, S, *cuts}))

    return {
        "full": {},
        "causal": dict(causal=True),
        "window 4": dict(causal=True, window=(4, 0)),
        "window 16": dict(causal=True, window=(16, 0)),
        "window 40": dict(causal=True, window=(40, 0)),
        "window 8 both sides": dict(window=(8, 8)),
        "documents of 8": dict(causal=True, cu_seqlens=np.arange(0, S + 1, 8)),
        "documents of 24": dict(causal=True, cu_seqlens=docs(*range(24, S, 24))),
        "documents 1/8, 3/8, 1/2": dict(causal=True, cu_seqlens=docs(2 * n, 8 * n)),
        "frames of 8": dict(causal=True, causal_block=8),
        "frames of 32": dict(causal=True, causal_block=32),
        "window 8 + documents of 24": dict(causal=True, window=(8, 0), cu_seqlens=docs(*range(24, S, 24))),
    }


def minimum_bytes(S, P, layout, mask, shape=ZOO_SHAPE):
    """Forward K/V bytes if each rank receives exactly the blocks its queries see, once (from ``definition_mask``)."""
    pos = np.arange(S)
    seen = definition_mask(pos, pos, **mask)
    shards = [shard_indices(S, P, r, layout) for r in range(P)]
    per_token = shape["batch"] * shape["hk"] * (shape["dim"] + shape["dim_v"]) * shape["itemsize"]
    return sum(len(shards[j]) * per_token for r in range(P) for j in range(P)
               if j != r and seen[np.ix_(shards[r], shards[j])].any())


def measured_bytes(comm, q, k, v, do, shape, **options):
    """``(forward, backward)`` bytes this rank sent for ``ring_attention`` and its backward with ``options``, and
    whether both equal ``nodes.predicted_bytes`` for ``shape``."""
    fwd, bwd = Record(), Record()
    out, lse = ring_attention(q, k, v, comm, record=fwd, **options)
    ring_attention_backward(do, q, k, v, out, lse, comm, record=bwd, **options)
    sent = (fwd.bytes_sent, bwd.bytes_sent)
    return sent, sent == tuple(predicted_bytes(fwd.plan, **shape, backward=b)[comm.Get_rank()] for b in (False, True))


def _arrays(rng, S, shape, rows):
    """Q, K, V, dO of ``shape`` over S tokens from ``rng`` (whole, on every rank), then this rank's ``rows``."""
    b, hq, hk, d, dv = (shape[x] for x in ("batch", "hq", "hk", "dim", "dim_v"))
    whole = [rng.standard_normal((b, h, S, w)).astype(np.float32) for h, w in ((hq, d), (hk, d), (hk, dv), (hq, dv))]
    return [np.ascontiguousarray(a[..., rows, :]) for a in whole]


def zoo_rows(comm, names=None, seed=0):
    """The zoo's rows at this P: ``(mask, layout, minimum, {column: (forward, backward)})``, sums over the ranks
    (the same on every rank), and whether every rank's bytes equalled its prediction."""
    P = comm.Get_size()
    S = TOKENS * P
    masks = zoo_masks(S)
    found, predicted = [], True
    for name in names or masks:
        for layout in LAYOUTS:
            sent = {}
            for column, mode in MOVEMENTS.items():
                arrays = _arrays(np.random.default_rng(seed), S, ZOO_SHAPE, shard_indices(S, P, comm.Get_rank(),
                                                                                             layout))
                mine, ok = measured_bytes(comm, *arrays, ZOO_SHAPE, layout=layout, mode=mode, **masks[name])
                every = comm.allgather((mine, ok))
                predicted &= all(o for _, o in every)
                sent[column] = tuple(sum(m[i] for m, _ in every) for i in (0, 1))
            found.append((name, layout, minimum_bytes(S, P, layout, masks[name]), sent))
    return found, predicted


def topk_rows(comm, rows=None, seed=0):
    """``[(S, k, inputs, {column: bytes summed over the ranks})]`` of ``rows`` (default ``TOPK_ROWS``), and whether
    every rank's bytes equalled its model."""
    P, rank = comm.Get_size(), comm.Get_rank()
    rows = TOPK_ROWS if rows is None else rows
    found, ok = [], True
    for n, k, inputs in rows:
        S = n * P
        rng = np.random.default_rng([seed, S, k])
        iq, ik = (rng.standard_normal((h, S, INDEX["dim"])).astype(np.float32) for h in (INDEX["heads"], 1))
        w = rng.random((INDEX["heads"], S)).astype(np.float32)
        if inputs == "local":  # the last 12 dims: 2 (cos, sin)(w t), so q_t . k_s gains 4 sum cos(w (t - s))
            angle = np.arange(S)[:, None] * FREQUENCIES[None, :]
            for x in (iq, ik):
                x[..., -12:] = 2 * np.concatenate([np.cos(angle), np.sin(angle)], axis=-1)
        mine = shard_indices(S, P, rank, "zigzag")
        arrays = _arrays(rng, S, TOPK_SHAPE, mine)
        index = Record()
        sel = select_topk(iq[:, mine], ik[:, mine], comm, topk=k, block=BLOCK, weights=w[:, mine], seq_len=S,
                          layout="zigzag", record=index)
        ok &= index.bytes_sent == (P - 1) * len(mine) * (INDEX["dim"] * 4 + min(k, S // BLOCK) * 4)
        sent = {"indexer": _sum(comm, index.bytes_sent)}
        for column, options in (("top-k sparse", dict(mode="sparse", mask=sel)), ("dense ring", dict(causal=True))):
            mine_sent, right = measured_bytes(comm, *arrays, TOPK_SHAPE, layout="zigzag", **options)
            ok &= right
            sent[f"{column} fwd"], sent[f"{column} bwd"] = (_sum(comm, b) for b in mine_sent)
        found.append((S, k, inputs, sent))
    return found, bool(comm.allreduce(int(not ok)) == 0)


def latent_rows(comm, shapes=None, seed=0):
    """``[(name, {column: bytes per token moved})]`` of ``shapes`` (default ``LATENT_SHAPES``), the ring's, causal,
    zigzag, float32; and whether they equal ``core.mla``'s formulas (forward K/V; backward K/V and the
    partials, in float32)."""
    P, rank = comm.Get_size(), comm.Get_rank()
    shapes = LATENT_SHAPES if shapes is None else shapes
    found, ok = [], True
    for name, s in shapes.items():
        S, H = TOKENS * P, s["heads"]
        rng = np.random.default_rng([seed, H])
        q, c, kr, do = (rng.standard_normal((h, S, d)).astype(np.float32)
                        for h, d in ((H, s["d_nope"] + s["dr"]), (1, s["r"]), (1, s["dr"]), (H, s["dv"])))
        wk, wv = (rng.standard_normal((H, s["r"], d)).astype(np.float32) / np.sqrt(s["r"]) for d in (s["d_nope"],
                                                                                                     s["dv"]))
        k, v = (a.astype(np.float32) for a in expand(c, kr, wk, wv))
        mine = shard_indices(S, P, rank, "zigzag")
        q, c, kr, do, k, v = (np.ascontiguousarray(x[..., mine, :]) for x in (q, c, kr, do, k, v))
        recs = [Record() for _ in range(4)]
        options = dict(causal=True, layout="zigzag")
        out, lse = mla_attention(q, c, kr, wk, wv, comm, record=recs[0], **options)
        mla_attention_backward(do, q, c, kr, wk, wv, out, lse, comm, record=recs[1], sum_weights=False, **options)
        out, lse = ring_attention(q, k, v, comm, record=recs[2], **options)
        ring_attention_backward(do, q, k, v, out, lse, comm, record=recs[3], **options)
        moved = _sum(comm, sum(tokens for _, tokens in kv_tokens_sent(recs[0].plan, rank)))
        per = [_sum(comm, r.bytes_sent) / moved if moved else 0.0 for r in recs]
        heads = per_head_bytes(H, s["d_nope"], s["dr"], s["dv"], 4)
        want = [latent_bytes(s["r"], s["dr"], 4), 2 * latent_bytes(s["r"], s["dr"], 4), heads, 2 * heads]
        ok &= not moved or per == want
        found.append((name, dict(zip(("latent fwd", "latent bwd", "per-head fwd", "per-head bwd"), per))))
    return found, ok


def topk_table(found, P, markdown=False):
    columns = list(found[0][3]) if found else []
    body = [[str(P), inputs, str(S), str(k), str(k * BLOCK)] + [str(sent[c]) for c in columns]
            + [f"{sent['top-k sparse fwd'] / sent['dense ring fwd']:.2f}" if sent["dense ring fwd"] else "-"]
            for S, k, inputs, sent in found]
    return table_text(["P", "indexer inputs", "S", "k blocks", "keys per query"] + columns + ["sparse/ring fwd"], body,
                  markdown)


def latent_table(found, P, markdown=False, shapes=None):
    body = []
    for name, per in found:
        s = {**LATENT_SHAPES, **(shapes or {})}[name]
        shape = f"{s['heads']} heads, r {s['r']}, rope {s['dr']}, d_nope {s['d_nope']}, dv {s['dv']}"
        body.append([str(P), name, shape] + [f"{per[c]:g}" for c in per]
                    + [f"{per['latent fwd'] / per['per-head fwd']:.4f}" if per["per-head fwd"] else "-"])
    head = ["P", "model", "shape", "latent fwd", "latent bwd", "per-head fwd", "per-head bwd", "latent/per-head"]
    return table_text(head, body, markdown)


def zoo_table(found, P, markdown=False):
    """The rows as a table: bytes summed over the ranks, forward then backward."""
    head = (["P", "mask", "layout", "minimum"] + [f"{c} fwd" for c in MOVEMENTS] + [f"{c} bwd" for c in MOVEMENTS]
            + ["sparse/minimum", "sparse/ring fwd"])
    body = []
    for name, layout, least, sent in found:
        body.append([str(P), name, layout, str(least)] + [str(sent[c][0]) for c in MOVEMENTS]
                    + [str(sent[c][1]) for c in MOVEMENTS]
                    + [_ratio(sent["sparse"][0], least), _ratio(sent["sparse"][0], sent["ring"][0])])
    return table_text(head, body, markdown)


def _ratio(a, b):
    return "-" if b == 0 else f"{a / b:.2f}"


def _zoo_note(P, verdict):
    return (f"\nP = {P}, {TOKENS} tokens per rank, K/V {ZOO_SHAPE['batch'] * ZOO_SHAPE['hk']} head(s) of "
            f"{ZOO_SHAPE['dim']} + {ZOO_SHAPE['dim_v']} float32; bytes summed over the ranks. Every rank's measured "
            f"bytes {verdict} the cost model's (nodes.predicted_bytes).")


def _topk_note(P, verdict):
    return (f"\nbytes summed over the ranks; zigzag, causal, blocks of {BLOCK} tokens; K/V one head of "
            f"{TOPK_SHAPE['dim']} + {TOPK_SHAPE['dim_v']} float32, DSA's indexer {INDEX['heads']} heads of "
            f"{INDEX['dim']}. Every rank's bytes {verdict} the models (nodes.predicted_bytes, select_topk's).")


def _latent_note(P, verdict):
    return (f"\nbytes sent per token moved, summed over the ranks; the causal ring, zigzag, {TOKENS} tokens per "
            f"rank, float32; backward: K/V again and the partials (dc_kv, dk_rope or dK, dV), the weights' "
            f"all-reduce left out. Measured {verdict} core.mla's formulas.")


# command: (its rows from (comm, options), their table, the doc holding it, the note under it)
TABLES = {"zoo": (lambda comm, args: zoo_rows(comm, args.mask), zoo_table, "docs/balance.md", _zoo_note),
            "topk": (lambda comm, _: topk_rows(comm), topk_table, "docs/masks.md", _topk_note),
            "latent": (lambda comm, _: latent_rows(comm), latent_table, "docs/training.md", _latent_note)}


def _parser(name):
    p = command_parser(f"bench {name}", globals()[name])
    p.add_argument("--markdown", action="store_true", help=f"a Markdown table ({TABLES[name][2]})")
    if name == "zoo":
        p.add_argument("--mask", action="append", help="only this mask of the zoo (repeatable)")
    return p


def _report(name, comm, args):
    """Command ``name``: measure its rows, print the table and the note on rank 0; exit 1 if a measurement
    differs from its model."""
    rows, table, _, note = TABLES[name]
    args = _parser(name).parse_args(args)
    if name == "zoo":
        masks = zoo_masks(TOKENS * comm.Get_size())
        unknown = sorted(set(args.mask or ()) - set(masks))
        if unknown:
            raise Agreed(f"--mask: unknown masks {unknown}: the zoo has {', '.join(masks)}")
    found, ok = rows(comm, args)
    if comm.Get_rank() == 0:
        print(table(found, comm.Get_size(), args.markdown))
        print(note(comm.Get_size(), "equal" if ok else "DIFFER FROM"))
    return 0 if ok else 1


zoo_parser, topk_parser, latent_parser = (functools.partial(_parser, name) for name in TABLES)


def zoo(comm, args=None):
    """Bytes each movement sends for a zoo of masks, measured, against the minimum and the cost model."""
    return _report("zoo", comm, args)


def topk(comm, args=None):
    """Bytes of top-k attention chosen by an indexer against the dense ring, as S and k vary, measured."""
    return _report("topk", comm, args)


def latent(comm, args=None):
    """Bytes per token of MLA's latent on the ring against per-head K/V, measured."""
    return _report("latent", comm, args)
