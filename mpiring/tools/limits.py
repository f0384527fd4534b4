"""What one core of this machine can do: its BLAS, and the kernels' GEMM and np.exp rates on attention tiles.

    python mpiring/tools/limits.py --gemm-probe     # what the benchmark runs in a child process

Run as a script it imports no part of the package, so the child never starts MPI.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

__all__ = ["blas_report", "measure_limits", "limit_seconds", "best_seconds"]


def best_seconds(fn, repeats):
    """The fastest of ``repeats`` calls of ``fn``, after one call to warm up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _blas_pools():
    return [p for p in threadpool_info() if p.get("user_api") == "blas"]


def _tile_gemms(rng, n, d, dtype, mm=None):
    """The two forward GEMMs of one (n x n) attention tile with head dim ``d``, as a function to time.

    ``mm``: a ``mpiring.core.gemm`` product (the kernels' backend); None: ``np.matmul``.
    """
    q = rng.standard_normal((n, d), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((n, d), dtype=np.float32).astype(dtype)
    s, o = np.empty((n, n), dtype), np.empty((n, d), dtype)
    mm = mm or (lambda a, b, out: np.matmul(a, b, out=out))

    def gemms():
        mm(q[None], k.T[None], s[None])
        mm(s[None], k[None], o[None])

    return gemms


def _gemm_probe(n=1024, d=64, repeats=5):
    """This process's BLAS: kernel family and single-thread fp32 GFLOP/s on one attention tile's GEMMs."""
    pools = _blas_pools()
    gemms = _tile_gemms(np.random.default_rng(2), n, d, np.float32)
    with threadpool_limits(1, user_api="blas"):
        seconds = best_seconds(gemms, repeats)
    return {"arch": pools[0].get("architecture") if pools else None, "gflops": 4 * n * n * d / seconds / 1e9}


def blas_report(check_free=True):
    """BLAS library, version, kernel family and threads; warns about a forced OPENBLAS_CORETYPE.

    When OPENBLAS_CORETYPE is set, a child interpreter without it tells which
    kernels OpenBLAS picks by itself and how fast its GEMMs run on one core; the
    same GEMMs are timed here, and a forced kernel family that is slower (or
    different, when the timing is unclear) is reported as a warning.
    """
    from .probes import child_env  # here, not at the top: this file also runs as a script

    pools = _blas_pools()
    pool = pools[0] if pools else {}
    report = {
        "blas": f"{pool.get('internal_api', 'unknown')} {pool.get('version', '')}".strip(),
        "blas_arch": pool.get("architecture") or "unknown",
        "blas_threads": pool.get("num_threads", 0),
        "coretype_env": os.environ.get("OPENBLAS_CORETYPE"),
        "free_arch": None,
        "warning": None,
    }
    if report["coretype_env"] and check_free and pool.get("internal_api") == "openblas":
        env = {k: v for k, v in child_env().items() if k != "OPENBLAS_CORETYPE"}
        try:
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--gemm-probe"], env=env,
                                 capture_output=True, text=True, timeout=120, check=True).stdout
            free = json.loads(out.strip().splitlines()[-1])
        except (subprocess.SubprocessError, OSError, ValueError, IndexError):
            free = {"arch": None, "gflops": None}
        report["free_arch"] = free["arch"]
        if free["arch"] and free["arch"].lower() != str(report["blas_arch"]).lower():
            forced = _gemm_probe()["gflops"]
            speed = (f"; one-core GEMM {forced:.0f} GFLOP/s forced vs {free['gflops']:.0f} free"
                     if free["gflops"] else "")
            verdict = ("below what the CPU can do" if not free["gflops"] or free["gflops"] > 1.05 * forced
                       else "not slower on this CPU")
            report["warning"] = (f"OPENBLAS_CORETYPE={report['coretype_env']} forces {report['blas_arch']} kernels; "
                                 f"OpenBLAS picks {free['arch']} on this CPU when the variable is unset{speed} "
                                 f"(forced kernels: {verdict})")
    return report


def measure_limits(dims, n=1024, repeats=5, dtype=np.float32):
    """Single-core GEMM FLOP/s (the kernels' backend, ``core.gemm``) and exponentials/s on one ``n`` x ``n`` tile.

    For each head dim d: the two forward GEMMs of a tile, ``(n, d) @ (d, n)``
    and ``(n, n) @ (n, d)``, timed together (best of ``repeats``), and the faster
    of ``np.exp`` and ``np.exp2`` on n*n scores in [-16, 0) written to a second
    buffer. Also the machine's ceiling: one core's GEMM on a square
    2048 x 2048 fp32 product, the fastest GEMM this BLAS runs (no attention
    kernel can beat it, since every score costs 4*d GEMM FLOPs).
    Returns ``{d: {"gemm_flops": .., "exp_per_s": .., "exp_fn": .., "peak_flops": ..}}``.
    """
    rng = np.random.default_rng(1)
    src = (rng.random((n, n), dtype=np.float32) * -16).astype(dtype)
    dst = np.empty_like(src)
    exp_rate, exp_fn = 0.0, "exp"
    from mpiring.core import gemm  # here, not at the top: this file also runs as a script

    with threadpool_limits(1, user_api="blas"):
        mm = gemm.product()  # the GEMMs the kernels use with one thread: NumPy's or MKL's
        gemm_name = "MKL" if mm is gemm.gemm_mkl else "np.matmul"
        for name, fn in (("exp", np.exp), ("exp2", np.exp2)):
            rate = n * n / best_seconds(lambda fn=fn: fn(src, out=dst), repeats)
            if rate > exp_rate:
                exp_rate, exp_fn = rate, name
        big = rng.standard_normal((2048, 2048), dtype=np.float32)
        square = np.empty_like(big)
        peak = 2 * 2048 ** 3 / best_seconds(lambda: mm(big[None], big[None], square[None]), max(2, repeats // 2))
        limits = {}
        for d in dims:
            gemm_flops = 4 * n * n * d / best_seconds(_tile_gemms(rng, n, d, dtype, mm), repeats)
            limits[d] = {"gemm_flops": gemm_flops, "exp_per_s": exp_rate, "exp_fn": exp_fn, "peak_flops": peak,
                         "gemm_name": gemm_name}
    return limits


def limit_seconds(limits, cfg, pairs):
    """Time of the matmul+exp limit for ``pairs`` visible (query, key) pairs per head of benchmark row ``cfg``."""
    lim = limits[cfg.D]
    gemm = (14 if cfg.backward else 4) * cfg.D / lim["gemm_flops"]
    exps = (2 if cfg.backward else 1) / lim["exp_per_s"]
    return cfg.B * cfg.H * pairs * (gemm + exps)


if __name__ == "__main__" and sys.argv[1:] == ["--gemm-probe"]:
    print(json.dumps(_gemm_probe()))
