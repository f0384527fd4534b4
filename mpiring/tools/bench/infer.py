"""The benchmark's inference rows (decode with tree and ring merges, prefill passing K/V or Q) and the serving
table of docs/inference.md (decode, speculative verify and Helix over 64k- and 256k-token caches).

    mpiexec -n 2 python -m mpiring bench --inference only     # the rows (the full table prints them too)
    mpiexec -n 4 python -m mpiring bench serving              # the serving table: minutes at 256k tokens

Caches are filled with ``KVCache.extend``; every result is checked against the float64 reference before it
counts; times are the slowest rank's, next to the time model's with this machine ``calibrate``d.
"""

import time
from functools import partial

import numpy as np
from mpi4py import MPI

from mpiring import KVCache, Record, ring_attention
from mpiring.cost.infercost import decode_time, helix_time, meta_rule, prefill_time
from mpiring.helix import HelixGrid, helix_attention
from mpiring.parallel.passq import chosen_rotation
from mpiring.testing import TOLERANCE

from ..calibrate import calibrate
from ..cli import command_parser, on_rank0
from ..cli_generate import grouped_reference

__all__ = ["inference_rows", "decode_row", "prefill_row", "serving_rows", "helix_row", "serving", "serving_parser"]


def _machine(comm, dim):
    return calibrate(comm, head_dim=dim, tokens=256, seconds=0.2, nbytes=1 << 22)


def _slowest(comm, call, repeats):
    """The fastest of ``repeats`` runs of ``call()`` timed on the slowest rank: ``(seconds, last result)``."""
    best, result = float("inf"), None
    for _ in range(repeats):
        comm.Barrier()
        start = time.perf_counter()
        result = call()
        best = min(best, comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return best, result


def _alone(comm, K, V, Q, kv_heads, dim):
    """Rank 0, the others asleep: the median seconds of one ``attend`` per query of ``Q`` over the whole cache
    ``K``, ``V`` on COMM_SELF (None on the other ranks)."""
    def steps_alone():
        with KVCache(MPI.COMM_SELF, kv_heads, dim) as alone:
            alone.extend(K, V)
            return float(np.median([_slowest(MPI.COMM_SELF, partial(alone.attend, Q[..., t:t + 1, :]), 1)[0]
                                    for t in range(Q.shape[-2])]))
    return on_rank0(comm, steps_alone)


def serving_rows(comm, cache=65536, steps=8, draft=4, heads=8, kv_heads=2, dim=64, seed=0, repeats=3):
    """``steps`` decode tokens over ``cache`` tokens (tree, ring, rank 0 alone), bytes against the model, and
    (``draft``) one speculative ``verify`` of ``draft`` tokens against ``draft`` separate decode calls. Every
    result is checked against the float64 reference on rank 0. A dict on rank 0."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(seed)
    K, V = (rng.standard_normal((1, kv_heads, cache + draft, dim), dtype=np.float32) for _ in range(2))
    Q = rng.standard_normal((1, heads, max(steps, draft), dim), dtype=np.float32)
    machine = _machine(comm, dim)
    row = {"cache": cache, "P": size, "steps": steps, "heads": heads, "kv_heads": kv_heads, "dim": dim, "error": 0.0}

    def check(got, q, end, causal):
        if rank == 0:
            want = grouped_reference(q, K[..., :end, :].astype(np.float64), V[..., :end, :].astype(np.float64),
                                     np.arange(end - q.shape[-2], end), causal)
            row["error"] = max(row["error"], float(np.abs(got[0] - want[0]).max()))

    with KVCache(comm, kv_heads, dim) as kv:
        kv.extend(K[..., :cache, :], V[..., :cache, :])
        row["nbytes"] = kv.nbytes
        for merge in ("tree", "ring"):
            walls, sent = [], []
            for t in range(steps):
                rec = Record(rank)
                wall, got = _slowest(comm, partial(kv.attend, Q[..., t:t + 1, :], merge=merge, record=rec), 1)
                walls.append(wall)
                sent.append(comm.allreduce(rec.bytes_sent, op=MPI.MAX))
                check(got, Q[..., t:t + 1, :], cache, False)
            model = decode_time(cache, size, heads=heads, head_dim=dim, machine=machine, merge=merge)
            row[merge] = {"latency": float(np.median(walls)), "model": model["total_s"],
                          "bytes": int(np.median(sent)), "model_bytes": model["transfers"] * model["partial_bytes"]}
        if draft:
            qd = Q[..., :draft, :]
            dk, dv = K[..., cache:cache + draft, :], V[..., cache:cache + draft, :]
            row["verify"], got = _slowest(comm, lambda: kv.verify(qd, dk, dv), repeats)
            check(got, qd, cache + draft, True)
            row["separate"], _ = _slowest(comm, lambda: [kv.attend(Q[..., i:i + 1, :]) for i in range(draft)],
                                          repeats)
            row["verify_model"] = decode_time(cache, size, heads=heads, head_dim=dim, machine=machine,
                                              new_tokens=draft)["total_s"]
    row["alone"] = _alone(comm, K[..., :cache, :], V[..., :cache, :], Q[..., :steps, :], kv_heads, dim)
    row["ok"] = row["error"] <= TOLERANCE[np.dtype(np.float32)]
    return row if rank == 0 else None


def decode_row(comm, cache=65536, steps=16, **shape):
    """Per-token decode latency over ``cache`` tokens: tree, ring and rank 0 alone, against the model. Text on
    rank 0."""
    r = serving_rows(comm, cache, steps, draft=0, **shape)
    if r is None:
        return None
    return (f"decode: cache {cache} tokens, P={r['P']}, {r['heads']} heads / {r['kv_heads']} K/V heads, "
            f"D={r['dim']}, float32, {steps} steps, cache {r['nbytes'] / 2**20:.1f} MiB on rank 0: per-token latency "
            f"(median of the slowest rank) tree {_ms(r['tree']['latency'])} ms (model {_ms(r['tree']['model'])} ms), "
            f"ring {_ms(r['ring']['latency'])} ms (model {_ms(r['ring']['model'])} ms), single process "
            f"{_ms(r['alone'])} ms; max error {r['error']:.1e} {'ok' if r['ok'] else 'FAILED'}")


def helix_row(comm, cache=65536, batch=4, heads=12, kv_heads=2, dim=64, seed=0, repeats=3):
    """Helix over a KVP x TP grid (TP = 2 when P is even and above 2, else 1): one token per sequence of a
    batch, with and without HOP-B (``chunks`` = 1 and = batch), against ``helix_time``. A dict on rank 0.
    12 query heads: a multiple of TP x KVP for every P = 1..4."""
    rank, size = comm.Get_rank(), comm.Get_size()
    tp = 2 if size % 2 == 0 and size > 2 else 1
    machine = _machine(comm, dim)
    row = {"cache": cache, "P": size, "tp": tp, "kvp": size // tp, "batch": batch, "error": 0.0}
    Q = np.random.default_rng([seed, 0]).standard_normal((batch, heads, 1, dim), dtype=np.float32)
    with HelixGrid(comm, tp) as grid:
        hq, hk = heads // tp, kv_heads // tp
        mine = np.arange(grid.kvp_rank, cache, grid.kvp_size)
        shards = []
        for b in range(batch):  # one sequence at a time: never the whole batch's cache on one rank
            K, V = (np.random.default_rng([seed, 1 + b, c]).standard_normal((kv_heads, cache, dim), dtype=np.float32)
                    for c in range(2))
            shards.append([X[grid.tp_rank * hk:(grid.tp_rank + 1) * hk][:, mine] for X in (K, V)])
            del K, V
        k, v = (np.stack([s[i] for s in shards]) for i in range(2))
        q = Q[:, grid.tp_rank * hq:(grid.tp_rank + 1) * hq]
        for chunks in (1, batch):
            rec = Record(rank)
            row[f"chunks {chunks}"], out = _slowest(comm, partial(helix_attention, q, k, v, grid, chunks=chunks,
                                                                  record=rec), repeats)
            model = helix_time(cache, size // tp, tp, heads=heads, head_dim=dim, batch=batch, chunks=chunks,
                               machine=machine)
            row[f"model {chunks}"] = model["overlap_s"]
            row[f"serial model {chunks}"] = model["serial_s"]
            row["bytes"], row["model_bytes"] = comm.allreduce(rec.bytes_sent, op=MPI.MAX) // repeats, model["bytes"]
        heads_at = grid.tp_rank * hq + grid.kvp_rank * (hq // grid.kvp_size)
        outs = comm.gather((heads_at, out[0]))
    if rank == 0:
        full = np.zeros((batch, heads, 1, dim))
        for at, o in outs:
            full[:, at:at + o.shape[1]] = o
        for b in range(batch):
            K, V = (np.random.default_rng([seed, 1 + b, c]).standard_normal((kv_heads, cache, dim), dtype=np.float32)
                    for c in range(2))
            want = grouped_reference(Q[b:b + 1], K[None].astype(np.float64), V[None].astype(np.float64))
            row["error"] = max(row["error"], float(np.abs(full[b:b + 1] - want[0]).max()))
    row["ok"] = row["error"] <= TOLERANCE[np.dtype(np.float32)]
    return row if rank == 0 else None


def prefill_row(comm, new, cached, heads=8, kv_heads=1, dim=64, seed=0, repeats=2):
    """Prefill of ``new`` tokens after ``cached`` ones, passing K/V and passing Q: text on rank 0."""
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng([seed, new, cached])
    total = new + cached
    q_pos = np.arange(cached + rank, total, size)
    kv_pos = np.arange(rank, total, size)
    q = rng.standard_normal((1, heads, len(q_pos), dim), dtype=np.float32)
    k, v = (rng.standard_normal((1, kv_heads, len(kv_pos), dim), dtype=np.float32) for _ in range(2))
    result = {}
    for rotate in ("kv", "q"):
        rec = Record(rank)
        call = partial(ring_attention, q, k, v, comm, causal=True, positions=q_pos, kv_positions=kv_pos,
                       rotate=rotate, record=rec)
        seconds, out = _slowest(comm, call, repeats)
        result[rotate] = (seconds, comm.allreduce(rec.bytes_sent, op=MPI.MAX) // repeats, out)
    same = float(np.abs(result["q"][2][0] - result["kv"][2][0]).max())
    auto = chosen_rotation("auto", rec.plan, q, k, v)
    machine = _machine(comm, dim)
    if rank != 0:
        return None
    kw = dict(heads=heads, kv_heads=kv_heads, head_dim=dim, bytes_per_element=4, machine=machine)
    model = {r: prefill_time(new, cached, size, rotate=r, **kw)["total_s"] for r in ("kv", "q")}
    return (f"prefill: T={new} new after C={cached} cached (T/(T+C) = {new / total:.3g}), P={size}, {heads} heads / "
            f"{kv_heads} K/V head, D={dim}, causal: pass-KV {result['kv'][0] * 1e3:.4g} ms, {result['kv'][1]} bytes "
            f"(model {model['kv'] * 1e3:.3g} ms); pass-Q {result['q'][0] * 1e3:.4g} ms, {result['q'][1]} bytes "
            f"(model {model['q'] * 1e3:.3g} ms); auto: {auto}, Meta's rule: "
            f"{meta_rule(new, cached, heads=heads, kv_heads=kv_heads)}; |pass-Q - pass-KV| {same:.1e}")


def _ms(seconds):
    return f"{seconds * 1e3:.3g}"


def serving_table(comm, caches=(65536, 262144), steps=8, draft=4, batch=4):
    """Markdown rows of ``serving_rows`` and ``helix_row`` for each cache size, printed on rank 0 as they finish."""
    lines = []
    for cache in caches:
        r, h = serving_rows(comm, cache, steps, draft), helix_row(comm, cache, batch)
        if comm.Get_rank() != 0:
            continue
        lines.append(
            f"| {cache} | {r['P']} | {_ms(r['tree']['latency'])} ({_ms(r['tree']['model'])}) | "
            f"{_ms(r['ring']['latency'])} ({_ms(r['ring']['model'])}) | {_ms(r['alone'])} | "
            f"{r['tree']['bytes']} / {r['tree']['model_bytes']}, {r['ring']['bytes']} / {r['ring']['model_bytes']} | "
            f"{_ms(r['verify'])} ({_ms(r['verify_model'])}) vs {_ms(r['separate'])} | "
            f"{h['kvp']}x{h['tp']}: {_ms(h['chunks 1'])} ({_ms(h['model 1'])}), HOP-B {_ms(h['chunks ' + str(batch)])} "
            f"({_ms(h['model ' + str(batch)])}); {int(h['bytes'])} / {int(h['model_bytes'])} B | "
            f"{max(r['error'], h['error']):.1e} {'ok' if r['ok'] and h['ok'] else 'FAILED'} |")
        print(lines[-1], flush=True)
    return lines


def inference_rows(comm, quick=False):
    """Every inference row (decode, then prefill at two cache ratios), printed on rank 0 as they finish."""
    cache, steps = (4096, 4) if quick else (65536, 16)
    ratios = [(256, 256), (64, 960)] if quick else [(2048, 2048), (512, 7680)]
    lines = [decode_row(comm, cache, steps)]
    if comm.Get_rank() == 0:
        print(lines[-1], flush=True)
    for new, cached in ratios:
        lines.append(prefill_row(comm, new, cached))
        if comm.Get_rank() == 0:
            print(lines[-1], flush=True)
    return lines


def serving_parser():
    p = command_parser("bench serving", serving)
    p.add_argument("--caches", type=int, nargs="+", default=[65536, 262144], metavar="TOKENS", help="cache sizes")
    return p


def serving(comm, args=None):
    """The serving table of docs/inference.md: decode, speculative verify and Helix per cache size (Markdown)."""
    serving_table(comm, serving_parser().parse_args(args).caches)
    return 0
