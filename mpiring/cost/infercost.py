"""Time model of inference: decoding with tree vs ring merges, prefill passing K/V vs passing Q. No MPI.

The same alpha-beta machines as ``mpiring.cost.costmodel`` (a FLOP rate, a
latency alpha and a bandwidth beta per transfer).

Decode: T new tokens against a cache of C tokens over P ranks. Every rank
computes its C/P keys (``4 B Hq T (C/P) D`` FLOPs), then the partials
``(out, lse)``, ``B Hq T (Dv + 1)`` float64 values, are merged: a tree
(recursive doubling) takes ceil(log2 P) transfers in a row, the ring P - 1.

Prefill with a cache (Meta, "Context Parallelism for Scalable Million-Token
Inference", 2024): T new tokens attend to C cached ones and to each other,
T/P new and (T + C)/P cached-or-new K/V tokens per rank. Pass-KV moves the K/V
blocks, ``2 B Hkv D e (T + C)/P`` bytes per step; pass-Q moves the query blocks,
``B Hq D e T/P`` bytes per step, and at the end sends every partial home
(P - 1 of them per rank, ``B Hq (Dv + 1) 8 T/P`` bytes each, float64). Meta's
rule compares the per-step messages only: pass-KV when
``T / (T + C) >= 2 Hkv / Hq``. This model also counts the partials coming
home, so it picks pass-KV when ``2 Hkv e (T + C) <= Hq T (e + 8 (Dv + 1) / D)``,
a lower crossover than Meta's.
"""

import math

import numpy as np

from .costmodel import PRESETS, time_text

__all__ = ["decode_time", "helix_time", "relayout_bytes", "prefill_time", "choose_rotate", "meta_rule",
           "format_inference_model", "ROTATIONS"]

ROTATIONS = ("kv", "q")
PARTIAL_ITEMSIZE = 8  # partial (out, lse) travel as float64


def _machine(machine):
    return PRESETS[machine] if isinstance(machine, str) else machine


def decode_time(cache_tokens, ranks, *, heads, head_dim, new_tokens=1, batch=1, machine="nvlink", merge="tree",
                value_dim=None):
    """Predicted seconds of one decode step: ``{"compute_s", "merge_s", "total_s", "transfers", "partial_bytes"}``."""
    m = _machine(machine)
    dv = head_dim if value_dim is None else value_dim
    per_rank = math.ceil(cache_tokens / ranks)
    compute = 2 * batch * heads * new_tokens * per_rank * (head_dim + dv) / m.flops
    partial = batch * heads * new_tokens * (dv + 1) * PARTIAL_ITEMSIZE
    if ranks == 1:
        transfers = 0
    elif merge == "tree":
        transfers = math.ceil(math.log2(ranks))
    elif merge == "ring":
        transfers = ranks - 1
    else:
        raise ValueError(f"merge must be 'tree' or 'ring', got {merge!r}")
    merge_s = transfers * m.transfer_time(partial)
    return {"compute_s": compute, "merge_s": merge_s, "total_s": compute + merge_s, "transfers": transfers,
            "partial_bytes": partial}


def helix_time(cache_tokens, kvp, tp, *, heads, head_dim, new_tokens=1, batch=1, chunks=1, machine="nvlink",
               value_dim=None):
    """Predicted seconds of one Helix decode step (``mpiring.helix``), with HOP-B over ``chunks`` batch parts.

    Per part of b = batch / chunks: compute ``4 b (Hq / TP) T (C / KVP) D`` FLOPs (D + Dv for 2D), then one
    all-to-all in the KVP group, KVP - 1 transfers of ``b (Hq / (TP KVP)) T (Dv + 1) 8`` bytes in a row.
    Without overlap the parts add up; with HOP-B the all-to-all of part i hides under the compute of part
    i + 1: ``c + (chunks - 1) max(c, a) + a``. Returns ``{"compute_s", "alltoall_s", "serial_s",
    "overlap_s", "bytes"}`` (bytes: what one rank sends in the whole step).
    """
    m = _machine(machine)
    dv = head_dim if value_dim is None else value_dim
    b = batch / chunks
    c = 2 * b * heads / tp * new_tokens * math.ceil(cache_tokens / kvp) * (head_dim + dv) / m.flops
    piece = b * heads / (tp * kvp) * new_tokens * (dv + 1) * PARTIAL_ITEMSIZE
    a = (kvp - 1) * m.transfer_time(piece) if kvp > 1 else 0.0
    return {"compute_s": chunks * c, "alltoall_s": chunks * a, "serial_s": chunks * (c + a),
            "overlap_s": c + (chunks - 1) * max(c, a) + a, "bytes": chunks * (kvp - 1) * piece}


def relayout_bytes(held, owner, token_bytes):
    """Bytes each rank sends to move a cache from one layout to another: ``[per rank]``.

    ``held[r]``: the positions rank r holds after the prefill; ``owner(positions)``: the rank that keeps each
    under the decode placement; ``token_bytes``: one token's K and V as stored. A token moves iff its owner
    changes, once, straight to its new owner.
    """
    return [int(np.count_nonzero(owner(np.asarray(p, np.int64)) != r)) * token_bytes for r, p in enumerate(held)]


def prefill_bytes(new_tokens, cache_tokens, ranks, *, heads, kv_heads, head_dim, batch=1, bytes_per_element=2,
                  value_dim=None):
    """Bytes one rank sends in a prefill: ``{"kv": ..., "q": ...}`` (pass-Q including its partials home)."""
    dv = head_dim if value_dim is None else value_dim
    e = bytes_per_element
    kv_block = batch * kv_heads * (head_dim + dv) * e * (new_tokens + cache_tokens) / ranks
    q_block = batch * heads * head_dim * e * new_tokens / ranks
    partial = batch * heads * (dv + 1) * PARTIAL_ITEMSIZE * new_tokens / ranks
    return {"kv": (ranks - 1) * kv_block, "q": (ranks - 1) * (q_block + partial),
            "kv_block": kv_block, "q_block": q_block, "partial": partial}


def prefill_time(new_tokens, cache_tokens, ranks, *, heads, kv_heads, head_dim, rotate, batch=1,
                 bytes_per_element=2, machine="nvlink", value_dim=None):
    """Predicted seconds of a prefill (causal among the new tokens) passing K/V or Q around the ring.

    Each of the P steps overlaps one block's compute (the busiest rank's
    share of the visible pairs, spread evenly) with one transfer; pass-Q then
    sends the partials home (an all-to-all: P - 1 transfers).
    """
    m = _machine(machine)
    dv = head_dim if value_dim is None else value_dim
    b = prefill_bytes(new_tokens, cache_tokens, ranks, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      batch=batch, bytes_per_element=bytes_per_element, value_dim=value_dim)
    pairs = new_tokens * cache_tokens + new_tokens * (new_tokens + 1) / 2
    step_compute = 2 * batch * heads * (head_dim + dv) * pairs / ranks / ranks / m.flops
    block = b["kv_block"] if rotate == "kv" else b["q_block"]
    steps = step_compute + (ranks - 1) * max(step_compute, m.transfer_time(block) if ranks > 1 else 0.0)
    home = (ranks - 1) * m.transfer_time(b["partial"]) if rotate == "q" and ranks > 1 else 0.0
    return {"total_s": steps + home, "bytes": b[rotate], "home_s": home}


def choose_rotate(new_tokens, cache_tokens, ranks, *, heads, kv_heads, head_dim, bytes_per_element=2,
                  value_dim=None, **_):
    """``"kv"`` or ``"q"``: the rotation that sends fewer bytes (ties: "kv")."""
    b = prefill_bytes(new_tokens, cache_tokens, ranks, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                      bytes_per_element=bytes_per_element, value_dim=value_dim)
    return "kv" if b["kv"] <= b["q"] else "q"


def meta_rule(new_tokens, cache_tokens, *, heads, kv_heads):
    """Meta's rule: ``"kv"`` when T / (T + C) >= 2 Hkv / Hq, else ``"q"``."""
    return "kv" if new_tokens / (new_tokens + cache_tokens) >= 2 * kv_heads / heads else "q"


def format_inference_model(total_seq_len, ranks, *, heads, kv_heads, head_dim, batch=1, bytes_per_element=2,
                           machines=("nvlink", "infiniband"), new_tokens=1,
                           fractions=(1.0, 0.5, 0.25, 0.1, 0.05, 0.01)):
    """The inference time model as text: decode tree vs ring; prefill pass-KV vs pass-Q at several T / (T + C)."""
    lines = [f"inference model: {total_seq_len} tokens over P={ranks}; {heads} query heads, {kv_heads} K/V heads, "
             f"head dim {head_dim}, {bytes_per_element} bytes/element, batch {batch}"]
    for machine in machines:
        m = _machine(machine)
        lines += ["", f"{m.name}: {m.note}",
                  f"decode, {new_tokens} new token(s) against a cache of {total_seq_len}: compute + merge "
                  f"(partials {batch * heads * new_tokens * (head_dim + 1) * PARTIAL_ITEMSIZE} bytes, float64)"]
        for merge in ("tree", "ring"):
            d = decode_time(total_seq_len, ranks, heads=heads, head_dim=head_dim, new_tokens=new_tokens, batch=batch,
                            machine=m, merge=merge)
            lines.append(f"  {merge:<5} {d['transfers']:>3} transfers  compute {time_text(d['compute_s']):>9}  "
                         f"merge {time_text(d['merge_s']):>9}  total {time_text(d['total_s']):>9}")
        lines.append(f"prefill of T new tokens after C cached (T + C = {total_seq_len}), causal: pass-KV vs pass-Q")
        lines.append(f"  {'T/(T+C)':>8} {'T':>9} {'KV bytes':>11} {'Q bytes':>11} {'pass-KV':>9} {'pass-Q':>9}  "
                     f"model  Meta")
        for f in fractions:
            T = max(1, round(total_seq_len * f))
            C = total_seq_len - T
            kw = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, batch=batch,
                      bytes_per_element=bytes_per_element, machine=m)
            kv, q = (prefill_time(T, C, ranks, rotate=r, **kw) for r in ROTATIONS)
            lines.append(f"  {T / total_seq_len:>8.3g} {T:>9} {kv['bytes']:>11.4g} {q['bytes']:>11.4g} "
                         f"{time_text(kv['total_s']):>9} {time_text(q['total_s']):>9}  "
                         f"{choose_rotate(T, C, ranks, **kw):>5}  {meta_rule(T, C, heads=heads, kv_heads=kv_heads):>4}")
    crossover = _crossover(heads, kv_heads, head_dim, bytes_per_element)
    lines += ["", f"crossover T/(T+C): this model (bytes, partials home counted) {crossover:.3g}; "
                  f"Meta's rule 2 Hkv / Hq = {2 * kv_heads / heads:.3g}"]
    return "\n".join(lines)


def _crossover(heads, kv_heads, head_dim, e, value_dim=None):
    """T / (T + C) above which pass-KV sends fewer bytes than pass-Q."""
    dv = head_dim if value_dim is None else value_dim
    return kv_heads * (head_dim + dv) * e / (heads * (head_dim * e + (dv + 1) * PARTIAL_ITEMSIZE))
