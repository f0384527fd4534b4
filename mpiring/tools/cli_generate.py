"""The ``generate`` command: prefill a sharded KV cache through the ring, then decode token by token, verified.

    mpiexec -n 4 python -m mpiring generate --prompt-len 4096 --new-tokens 16 --heads 8 --kv-heads 2 --dim 64
    mpiexec -n 2 python -m mpiring generate --prompt-len 65536 --new-tokens 32 --heads 8 --kv-heads 1 --quantize int8

Inputs are seeded (``tools.verify.Inputs``). The prompt goes through ``KVCache.prefill`` (the ring); each step
extends the cache by ``--step-tokens`` tokens (causal among themselves) and attends to the whole cache with
every merge asked for. Sampled prefill rows and every decode step are compared with the float64 reference,
and every rank's decode result must be the same bits. Rank 0 prints times, bytes, the time model, VERIFIED.
"""

import hashlib
import time
from functools import partial

import numpy as np

from mpiring.core.record import Record
from mpiring.core.reference import dense_attention
from mpiring.cost.infercost import decode_time
from mpiring.decode import EXCHANGES
from mpiring.kvcache import ERROR_BOUND, KVCache
from mpiring.testing import TOLERANCE

from . import verify
from .calibrate import calibrate
from .cli import Agreed, at_least, command_parser, heads_problem, with_threads

__all__ = ["generate", "generate_parser", "grouped_reference"]

PREFILL_SAMPLE = 32  # prompt rows per rank compared with the reference


def generate_parser():
    p = command_parser("generate", generate)
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens, prefilled through the ring")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens generated, --step-tokens per decode step")
    p.add_argument("--step-tokens", type=int, default=1,
                   help="new tokens per decode step (more than one: causal among themselves)")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, help="K/V heads (grouped-query attention); default = heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--merge", choices=[*EXCHANGES, "both"], default="both",
                   help="how the decode partials are merged (both: each step runs and times both)")
    p.add_argument("--quantize", choices=["float16", "int8"], help="store the cache compressed")
    p.add_argument("--rotate", choices=["kv", "q", "auto"], default="kv",
                   help="what travels the ring in the prefill: K/V blocks, query blocks, or the one with fewer bytes")
    p.add_argument("--placement", choices=["round_robin", "interleave", "contiguous"], default="round_robin",
                   help="which rank keeps each cached token")
    p.add_argument("--interleave", type=int,
                   help="placement 'interleave' with runs of this many tokens: token t on rank (t // n) %% P")
    p.add_argument("--speculative", type=int, default=0, metavar="T",
                   help="each step verifies a chain of T draft tokens in one call (KVCache.verify), then commits "
                        "a seeded number of them, 1 to T (0: plain decoding)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"], help="dtype of q, k, v")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    p.checks += [at_least(1, **{"--prompt-len": "prompt_len", "--new-tokens": "new_tokens", "--heads": "heads",
                                "--kv-heads": "kv_heads", "--dim": "dim", "--threads": "threads",
                                "--step-tokens": "step_tokens", "--interleave": "interleave"}),
                 at_least(0, **{"--seed": "seed", "--speculative": "speculative"}), heads_problem]
    return p


def grouped_reference(q, K, V, positions=None, causal=False):
    """Float64 reference of q (B, H, s, D) over K, V (B, G, S, D) without repeating K/V per query head.

    The g = H / G query heads of a group become g x s query rows of its K/V head.
    """
    B, H, s, D = q.shape
    G = K.shape[1]
    g = H // G
    rows = q.reshape(B, G, g * s, D)
    mask = None
    if causal:
        qp = np.tile(np.asarray(positions), g)
        kp = np.arange(K.shape[-2])
        mask = lambda a, b: kp[None, :] <= qp[a:b, None]  # noqa: E731 (dense_attention takes a function)
    out, lse = dense_attention(rows, K, V, None, mask)
    return out.reshape(B, H, s, -1), lse.reshape(B, H, s)


def _error(got, want):
    out, lse = got
    ref, ref_lse = want
    finite = np.isfinite(ref_lse)
    return max(float(np.abs(out - ref).max()), float(np.abs(np.where(finite, lse - ref_lse, 0)).max()))


@with_threads(generate_parser)
def generate(comm, args):
    """Prefill a KV cache sharded over the ranks, decode token by token; verify every step; rank 0 reports."""
    rank, size = comm.Get_rank(), comm.Get_size()
    if args.prompt_len < size:
        raise Agreed(f"--prompt-len {args.prompt_len} is shorter than the number of ranks {size}: the ring "
                     f"needs a prompt token on every rank")
    dtype, hk = np.dtype(args.dtype), args.kv_heads or args.heads
    N, T = args.prompt_len, args.new_tokens
    inputs = verify.Inputs(args.seed, 1, args.heads, hk, args.dim, dtype)
    every = np.arange(N + T + args.speculative)  # drafts may run past the last new token
    K, V = inputs.tokens("k", every), inputs.tokens("v", every)
    new_q = inputs.tokens("q", every[N:])
    K64, V64 = K.astype(np.float64), V.astype(np.float64)
    merges = list(EXCHANGES) if args.merge == "both" else [args.merge]
    tol = ERROR_BOUND[args.quantize] if args.quantize else TOLERANCE[dtype]

    placement = "interleave" if args.interleave is not None and args.placement == "round_robin" else args.placement
    args.placement = placement  # as the report names it
    try:
        cache = KVCache(comm, hk, args.dim, dtype=dtype, quantize=args.quantize, placement=placement,
                        interleave=args.interleave or 1)
    except ValueError as exc:
        raise Agreed(str(exc)) from exc
    with cache:
        mine = cache.prompt_positions(N)
        q = inputs.tokens("q", mine)
        rec = Record(rank)
        comm.Barrier()
        try:
            out, lse = cache.prefill(q, K[..., mine, :], V[..., mine, :], causal=True, record=rec,
                                     rotate=args.rotate)
        except ValueError as exc:
            raise Agreed(str(exc)) from exc
        prefill = {"time": rec.wall_time, "bytes": rec.bytes_sent, "rotate": rec.rotate}
        rows = np.sort(np.random.default_rng([args.seed, 7, rank]).choice(len(mine), min(len(mine), PREFILL_SAMPLE),
                                                                          replace=False))
        ref = grouped_reference(q[..., rows, :], K64[..., :N, :], V64[..., :N, :], mine[rows], causal=True)
        prefill["error"] = _error((out[..., rows, :], lse[..., rows]), ref)

        steps = {m: {"latency": [], "compute": [], "merge": [], "bytes": [], "error": [], "same": True}
                 for m in merges}
        extend_times, accepted, t = [], [], 0
        keep = np.random.default_rng([args.seed, 11])  # how many drafts each step keeps: the same on every rank
        while t < T:
            pos = N + t
            if args.speculative:  # a chain of drafts at positions pos ..., seen causally among themselves
                end = pos + args.speculative
                q_new, draft = new_q[..., t:end - N, :], (K[..., pos:end, :], V[..., pos:end, :])
                call = partial(cache.verify, q_new, *draft)
            else:  # this step's tokens: positions pos .. end - 1
                end = N + min(T, t + args.step_tokens)
                start = time.perf_counter()
                cache.extend(K[..., pos:end, :], V[..., pos:end, :])
                extend_times.append(time.perf_counter() - start)
                q_new = new_q[..., t:end - N, :]
                call = partial(cache.attend, q_new, causal=end - pos > 1)  # several tokens: causal among them
            want = grouped_reference(q_new, K64[..., :end, :], V64[..., :end, :], np.arange(pos, end),
                                     causal=end - pos > 1)
            _timed_step(comm, call, steps, want)
            if args.speculative:
                accepted.append(int(keep.integers(1, min(args.speculative, T - t) + 1)))
                start = time.perf_counter()
                cache.commit(np.arange(accepted[-1]))
                extend_times.append(time.perf_counter() - start)
                end = pos + accepted[-1]
            t = end - N
        nbytes = comm.gather(cache.nbytes)
        lengths = list(cache.lengths)
    machine = calibrate(comm, head_dim=args.dim, dtype=args.dtype, tokens=256, seconds=0.2, threads=args.threads,
                        nbytes=1 << 22)
    gathered = comm.gather((prefill, steps, extend_times))
    if rank != 0:
        return 0
    return _report(args, size, gathered, nbytes, lengths, machine, tol, merges, accepted)


def _timed_step(comm, call, steps, want):
    """``call`` once with each merge of ``steps``, timed: latency, compute, merge, bytes, error against ``want``,
    and whether every rank got the same bits."""
    for m, s in steps.items():
        rec = Record(comm.Get_rank())
        comm.Barrier()
        start = time.perf_counter()
        got = call(exchange=m, record=rec)
        s["latency"].append(time.perf_counter() - start)
        s["compute"].append(rec.compute_time)
        s["merge"].append(sum(e - b for name, b, e, _ in rec.events if name == "merge"))
        s["bytes"].append(rec.bytes_sent)
        s["error"].append(_error(got, want))
        digest = hashlib.sha1(got[0].tobytes() + got[1].tobytes()).hexdigest()
        s["same"] &= len(set(comm.allgather(digest))) == 1


def _ms(seconds):
    return f"{seconds * 1e3:.3g} ms"


def _report(args, size, gathered, nbytes, lengths, machine, tol, merges, accepted):
    hk = args.kv_heads or args.heads
    N, T = args.prompt_len, args.new_tokens
    print(f"generate: P={size}, prompt {N} tokens, {T} new, heads {args.heads}, K/V heads {hk}, dim {args.dim}, "
          f"{args.dtype}, cache {args.quantize or 'unquantized'}, placement {args.placement}"
          f"{f', interleave {args.interleave}' if args.interleave else ''}")
    prefill_time = max(g[0]["time"] for g in gathered)
    prefill_bytes = [g[0]["bytes"] for g in gathered]
    prefill_error = max(g[0]["error"] for g in gathered)
    rotate = gathered[0][0]["rotate"] + (" (auto)" if args.rotate == "auto" else "")
    print(f"prefill (ring passing {rotate}, causal): {_ms(prefill_time)} (slowest rank), bytes sent per rank "
          f"{prefill_bytes}, "
          f"max error of {min(N, PREFILL_SAMPLE * size)} sampled rows {prefill_error:.2e} "
          f"(tolerance {TOLERANCE[np.dtype(args.dtype)]:g})")
    dtype_bytes = 2 * hk * args.dim * np.dtype(args.dtype).itemsize
    print(f"cache bytes per rank: {nbytes} for {lengths} tokens ({args.dtype} values alone: "
          f"{[n * dtype_bytes for n in lengths]})")
    extend = np.concatenate([g[2] for g in gathered])
    n_steps = len(gathered[0][2])
    per_step = args.speculative or args.step_tokens
    if args.speculative:
        print(f"speculative: {len(accepted)} verify calls of {args.speculative} draft tokens (a chain), accepted "
              f"{accepted} (seeded); commit (agreement included): median {_ms(float(np.median(extend)))}")
    else:
        print(f"extend ({per_step} token(s), agreement included): median {_ms(float(np.median(extend)))}")
    print(f"time model ({machine.note}) vs measured, per {'verify call' if args.speculative else 'decode step'} of "
          f"{per_step} token(s), medians over {n_steps} steps (the slowest rank's each step):")
    print(f"  {'merge':<6} {'latency':>10} {'p95':>10} {'compute':>10} {'merge':>10} {'bytes/step':>11}   "
          f"{'model: compute':>15} {'merge':>10} {'total':>10}   max error")
    ok = prefill_error <= TOLERANCE[np.dtype(args.dtype)]
    for m in merges:
        per = {key: np.max([g[1][m][key] for g in gathered], axis=0) for key in ("latency", "compute", "merge")}
        error = max(max(g[1][m]["error"]) for g in gathered)
        same = all(g[1][m]["same"] for g in gathered)
        model = decode_time(N + T, size, heads=args.heads, head_dim=args.dim, machine=machine, merge=m,
                            new_tokens=per_step)
        print(f"  {m:<6} {_ms(np.median(per['latency'])):>10} {_ms(np.percentile(per['latency'], 95)):>10}"
              f" {_ms(np.median(per['compute'])):>10} {_ms(np.median(per['merge'])):>10}"
              f" {int(np.median(gathered[0][1][m]['bytes'])):>11}   {_ms(model['compute_s']):>15}"
              f" {_ms(model['merge_s']):>10} {_ms(model['total_s']):>10}   {error:.2e}"
              f"{'' if same else '  RESULTS DIFFER BETWEEN RANKS'}")
        ok &= error <= tol and same
    print("latency: the whole attend call (agreement, compute, merge); bytes/step: the ring's counted sends, the "
          "tree's ceil(log2 P) partials (recursive doubling); model compute is at the calibrated GEMM rate, "
          "decoding is memory-bound and slower")
    what = f"decode error bound {tol:g} ({args.quantize or args.dtype})"
    print(f"VERIFIED ({what}; identical bits on every rank)" if ok else f"NOT VERIFIED ({what})")
    return 0 if ok else 1
