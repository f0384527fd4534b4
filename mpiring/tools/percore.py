"""The ``percore`` command: one core, one block, where the forward kernel's time goes, and torch beside it.

    python -m mpiring percore                       # 8 heads x 4096 x 4096, D=64, float32, 2 torch threads
    python -m mpiring percore --seq 8192 --threads 2 --repeats 5

No MPI. On one core (one BLAS thread) it times, on the same full-mask block:

- the matmul+exp limit (the benchmark's ``kern%`` divides by it): the two
  GEMMs of a 1024 x 1024 tile of one head and one ``exp2`` per score;
- the kernel's three steps alone, on its own tiles and operands: Q·Kᵀ into
  the score tile, ``exp2`` in place, P·V added into the accumulator, nothing
  else (no offsets, masks, checks or merges);
- the kernel itself, ``attention_block`` on K/V in the form the ring keeps
  for its backend, merged into float64 accumulators as the ring does, with each kernel backend
  installed (``mpiring.core.backends``: numpy, and torch's flash-attention ops);
- torch's ``scaled_dot_product_attention`` with one thread, and with
  ``--threads`` threads (in a child process, when torch is installed).

Each row's fraction of this core's peak FMA rate (``tools.peak``), the
physical limit. Then what P ranks at each of those speeds would give against
torch with P threads on the same block: an upper bound of the ring's "x torch"
for a kernel of that speed (a ring at efficiency 1, no communication exposed).
"""

import math
import types

import numpy as np
from threadpoolctl import threadpool_limits

from mpiring.core import backends, gemm
from mpiring.core.kernels import LOG2E
from mpiring.core.machine import cpu_model, vector_extensions
from mpiring.core.tiles import default_tiles, pad_ones

from .cli import at_least, command_parser
from .limits import best_seconds, limit_seconds, measure_limits
from .peak import fma_peak_flops
from .torchref import torch_available, torch_times

__all__ = ["percore", "percore_parser", "kernel_steps"]


def percore_parser():
    p = command_parser("percore", percore)
    p.add_argument("--seq", type=int, default=4096, help="queries = keys of the block")
    p.add_argument("--heads", type=int, default=8, help="heads")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--threads", type=int, default=2, help="torch's threads for the P-thread comparison (P)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls of each (the fastest counts)")
    p.add_argument("--no-torch", action="store_true", help="leave torch out")
    p.checks.append(at_least(1, **{"--seq": "seq", "--heads": "heads", "--dim": "dim", "--threads": "threads",
                                   "--repeats": "repeats"}))
    return p


def kernel_steps(q, kt, vt, scale, tile_q, tile_k):
    """A function running the forward kernel's three steps alone over a block, on the kernel's tiles.

    ``q`` (B, S, D); ``kt``, ``vt`` the padded ``[k | 1]ᵀ``, ``[v | 1]ᵀ``. Per
    (query tile, key tile): scores = (scale·log2 e·q | 0)·[k | 1]ᵀ, exp2 in
    place, scores·[v | 1] added into a float accumulator by the GEMM. Returns
    ``(run, acc)``: acc (B, tile_q, Dv+1) holds what ``run()`` added up, over
    every query tile.
    """
    mm = gemm.product()
    b, sq, d = q.shape
    sk, dv = kt.shape[-1], vt.shape[1] - 1
    qa = np.zeros((b, sq, d + 1), q.dtype)    # the offset column: 0 here (the kernel puts -m there)
    np.multiply(q, scale * LOG2E, out=qa[..., :d])
    s = np.empty((b, min(tile_q, sq), min(tile_k, sk)), q.dtype)
    acc = np.zeros((b, min(tile_q, sq), dv + 1), q.dtype)

    def run():
        for a in range(0, sq, tile_q):
            n = min(a + tile_q, sq) - a
            for c in range(0, sk, tile_k):
                tile = s[:, :n, :min(c + tile_k, sk) - c]
                mm(qa[:, a:a + n], kt[:, :, c:c + tile_k], tile)
                np.exp2(tile, out=tile)
                mm(tile, vt[:, :, c:c + tile_k].transpose(0, 2, 1), acc[:, :n], beta=1.0)

    return run, acc


def percore(comm=None, args=None):
    """One core, one block: the forward kernel against its own GEMMs and exp2, the limit, and torch (no MPI)."""
    args = percore_parser().parse_args(args)
    dt, seq, h, d = np.dtype(args.dtype), args.seq, args.heads, args.dim
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((h, seq, d)).astype(dt) for _ in range(3))
    kt, vt = pad_ones(k), pad_ones(v)
    scale = 1.0 / math.sqrt(d)
    flops = 4 * h * seq * seq * d
    # the block as a benchmark row: what limit_seconds and torch_times take
    cfg = types.SimpleNamespace(S=seq, D=d, H=h, B=1, causal=False, backward=False, dtype=args.dtype)
    rows = {}
    with threadpool_limits(1, user_api="blas"):
        tq, tk = default_tiles(d, dt)
        limits = measure_limits([d], dtype=dt)
        rows["the matmul+exp limit"] = limit_seconds(limits, cfg, seq * seq)
        run, _ = kernel_steps(q, kt, vt, scale, tq, tk)
        rows["the kernel's three steps on its tiles"] = best_seconds(run, args.repeats)
        out, lse = np.zeros((h, seq, d)), np.full((h, seq), -np.inf)
        for name in [b for b in backends.available() if not (args.no_torch and b == "torch")]:
            with backends.using(name):
                padded = backends.takes_padded(dt, seq)  # K/V in the form the ring keeps for this backend
                kv = (kt, vt) if padded else (k, v)
                rows[f"the kernel (attention_block), {name}"] = best_seconds(
                    lambda: backends.attention_block(q, *kv, scale, padded=padded, into=(out, lse)),  # noqa: B023
                    args.repeats)
    torch_p = None
    if not args.no_torch and torch_available():
        one = torch_times([cfg], 1, repeats=args.repeats)[0]
        torch_p = torch_times([cfg], args.threads, repeats=args.repeats)[0]
        if one:
            rows["torch SDPA, 1 thread"] = one
    peak = fma_peak_flops()
    print(f"one core of {cpu_model()} ({vector_extensions()}): {h} heads x {seq} queries x {seq} keys, D={d}, "
          f"{dt.name}, full mask; GEMMs: {limits[d]['gemm_name']}; kernel tiles {tq} x {tk}; FMA peak "
          + (f"{peak / 1e9:.1f} GFLOP/s (float32)" if peak else "not measured (no C compiler)"))
    print(f"  {'':<40} {'ms':>9} {'GFLOP/s':>8} {'of limit':>9} {'of peak':>8}")
    limit = rows["the matmul+exp limit"]
    for name, sec in rows.items():
        of_peak = f"{flops / sec / peak:8.0%}" if peak else f"{'-':>8}"
        print(f"  {name:<40} {sec * 1e3:9.3f} {flops / sec / 1e9:8.1f} {limit / sec:9.2f} {of_peak}")
    if torch_p:
        p = args.threads
        print(f"torch SDPA, {p} threads: {torch_p * 1e3:.1f} ms, {flops / torch_p / 1e9:.1f} GFLOP/s "
              f"({flops / torch_p / 1e9 / p:.1f} per thread)")
        print(f"{p} ranks, each as fast as one core above, against torch with {p} threads on this block "
              f"(a ring at efficiency 1):")
        for name, sec in rows.items():
            print(f"  {name:<40} {torch_p * p / sec:5.2f}x torch")
    elif not args.no_torch:
        print("torch: not installed (pip install torch) or it failed: no torch rows")
    return 0
