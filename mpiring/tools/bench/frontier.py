"""Bytes of this year's attention forms under CP, measured: top-k chosen by an indexer, and MLA's latent.

    mpiexec -n 4 python -m mpiring bench topk                 # the top-k table at P = 4, on rank 0
    mpiexec -n 4 python -m mpiring bench latent --markdown    # the latent table, as docs/training.md holds it

``topk``: per sequence length and k, every rank runs DSA's indexer
(``select_topk``), then causal attention under the choice with the sparse
movement (only the chosen keys travel) and the dense causal ring, forward and
backward. Each rank's recorded bytes must equal the model's: the cost model's
(``nodes.predicted_bytes``) for the attention, ``select_topk``'s docstring
formula for the indexer. ``latent``: per model shape, the ring moves MLA's
latent (``mla_attention``) and, under the same plan, the per-head K and V
(``ring_attention`` on the expanded heads); bytes per token moved, measured,
against ``core.mla``'s formulas. Both exit 1 if a measurement differs.
"""

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
from mpiring.cost.by_strategy import kv_tokens_sent
from mpiring.cost.nodes import predicted_bytes

from ..cli import command_parser, table_text

__all__ = ["TOPK_ROWS", "SHAPE", "LATENT_SHAPES", "topk_rows", "latent_rows", "topk_table",
           "latent_table", "topk", "latent", "topk_parser", "latent_parser"]

# (tokens per rank, blocks kept, indexer inputs): "random", or "local" (keys near the query score higher)
TOPK_ROWS = [(n, k, inputs) for inputs in ("random", "local") for n in (64, 256) for k in (1, 2, 4)]
BLOCK, INDEX = 16, dict(heads=4, dim=32)  # tokens per block; DSA's indexer heads and their dim
FREQUENCIES = np.pi / (BLOCK * 2.0 ** np.arange(6))  # "local": cos(w (t - s)) summed over these, amplitude 2
SHAPE = dict(batch=1, hq=4, hk=1, dim=64, dim_v=64, itemsize=4)  # float32: 512 bytes of K and V per token
LATENT_SHAPES = {"DeepSeek-V3": dict(heads=128, d_nope=128, dr=64, dv=128, r=512),
                 "small": dict(heads=8, d_nope=32, dr=16, dv=32, r=64)}
TOKENS = 16  # tokens per rank of the latent rows


def _sum(comm, value):
    return comm.allreduce(int(value))


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
        b, hq, hk, d = (SHAPE[x] for x in ("batch", "hq", "hk", "dim"))
        Q, K, V, dO = (rng.standard_normal((b, h, S, d)).astype(np.float32) for h in (hq, hk, hk, hq))
        mine = shard_indices(S, P, rank, "zigzag")
        q, k_, v, do = (np.ascontiguousarray(x[..., mine, :]) for x in (Q, K, V, dO))
        index = Record()
        sel = select_topk(iq[:, mine], ik[:, mine], comm, topk=k, block=BLOCK, weights=w[:, mine], seq_len=S,
                          layout="zigzag", record=index)
        ok &= index.bytes_sent == (P - 1) * len(mine) * (INDEX["dim"] * 4 + min(k, S // BLOCK) * 4)
        sent = {"indexer": _sum(comm, index.bytes_sent)}
        for column, options in (("top-k sparse", dict(mode="sparse", mask=sel)), ("dense ring", dict(causal=True))):
            fwd, bwd = Record(), Record()
            out, lse = ring_attention(q, k_, v, comm, layout="zigzag", record=fwd, **options)
            ring_attention_backward(do, q, k_, v, out, lse, comm, layout="zigzag", record=bwd, **options)
            ok &= (fwd.bytes_sent, bwd.bytes_sent) == tuple(predicted_bytes(fwd.plan, **SHAPE, backward=x)[rank]
                                                            for x in (False, True))
            sent[f"{column} fwd"], sent[f"{column} bwd"] = _sum(comm, fwd.bytes_sent), _sum(comm, bwd.bytes_sent)
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


def _parser(name, func, doc):
    p = command_parser(f"bench {name}", func)
    p.add_argument("--markdown", action="store_true", help=f"a Markdown table ({doc})")
    return p


def _report(comm, args, parser, measure, table, note):
    """A command: measure the rows, print the table and ``note(ok)`` on rank 0; exit 1 if a measurement differs."""
    args = parser().parse_args(args)
    found, ok = measure(comm)
    if comm.Get_rank() == 0:
        print(table(found, comm.Get_size(), args.markdown))
        print(note("equal" if ok else "DIFFER FROM"))
    return 0 if ok else 1


def topk_parser():
    return _parser("topk", topk, "docs/masks.md")


def topk(comm, args=None):
    """Bytes of top-k attention chosen by an indexer against the dense ring, as S and k vary, measured."""
    return _report(comm, args, topk_parser, topk_rows, topk_table, lambda verdict: (
        f"\nbytes summed over the ranks; zigzag, causal, blocks of {BLOCK} tokens; K/V one head of {SHAPE['dim']} "
        f"+ {SHAPE['dim_v']} float32, DSA's indexer {INDEX['heads']} heads of {INDEX['dim']}. Every rank's bytes "
        f"{verdict} the models (nodes.predicted_bytes, select_topk's)."))


def latent_parser():
    return _parser("latent", latent, "docs/training.md")


def latent(comm, args=None):
    """Bytes per token of MLA's latent on the ring against per-head K/V, measured."""
    return _report(comm, args, latent_parser, latent_rows, latent_table, lambda verdict: (
        f"\nbytes sent per token moved, summed over the ranks; the causal ring, zigzag, {TOKENS} tokens per rank, "
        f"float32; backward: K/V again and the partials (dc_kv, dk_rope or dK, dV), the weights' all-reduce left "
        f"out. Measured {verdict} core.mla's formulas."))
