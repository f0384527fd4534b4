"""Tuning for this CPU: the GEMM backend and tile sizes that run the NumPy kernel fastest, cached. No MPI.

    python -m mpiring bench tune            # times the candidates on one core (under a minute), writes the cache
    python -m mpiring bench tune --show     # what the cache holds for this machine

The kernels' defaults were measured on one CPU; another CPU, or another
BLAS, may prefer other tiles. ``tune`` times the forward and the backward
kernel of a block (8 heads, 2048 x 2048 tokens, no mask) for each candidate
(GEMM backend, tile_q, tile_k) on one core with one BLAS thread, as a rank runs
under ``mpiexec`` with one rank per core, and keeps the fastest. Which kernel
backend computes a block (the NumPy kernel or torch's op) is not tuned: "auto"
follows ``backends.AUTO_ROWS``. Times are CPU seconds of the process (every candidate runs one thread), so
other jobs on the machine disturb the choice less. The cache is a JSON file
keyed by what decides the speed (CPU model, NumPy, BLAS, MKL present or not),
so one file serves the different nodes of a cluster that share a home
directory. Where it lives: ``MPIRING_TUNE_CACHE`` (a path, or ``off`` to
ignore any cache), else ``$XDG_CACHE_HOME/mpiring/tune.json``,
else ``~/.cache/mpiring/tune.json`` (``mpiring.core.tuning.machine`` reads it).

Tiles and GEMM backend change only the order of the sums: results agree to
rounding whatever the cache says (``tests/test_tune.py``).
"""

import functools
import json
import os
import tempfile
import time

import numpy as np

from ..kernels import attention_block, attention_block_backward
from ..tiles import BlockRun
from . import gemm
from .machine import cache_path, cached, machine_key

__all__ = ["tune", "candidates", "reread"]


def candidates(dtype):
    """The (tile_q, tile_k) pairs ``tune`` times: score tiles of one head from 256 KiB to 1 MiB.

    (256 x 512 and 1024 x 512 were dropped: never the fastest on the Xeon or the EPYC, docs/performance.md §14.)"""
    pairs = [(256, 256), (512, 256), (512, 512), (1024, 256)]  # float32
    return [(tq * 4 // np.dtype(dtype).itemsize, tk) for tq, tk in pairs]  # float64: half the rows


def _time(fn, repeats):
    """Fastest of ``repeats`` calls, in this process's CPU seconds (one thread: a machine shared with other jobs
    stretches the wall clock, the CPU time much less), after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def tune(dims=(64, 128), dtypes=("float32",), seq=2048, heads=8, repeats=2, backends=None, write=True,
         log=print):
    """Time every (backend, tiles) candidate on one core; cache and return the choice for this machine.

    Returns ``{"gemm": backend, "tiles": {kind: {dtype: {d: [tq, tk]}}}, "backend_seconds": {...}, ...}``:
    the GEMM backend with the least total time over all its best rows, and for it the fastest tiles of each
    kernel, head dim and dtype.
    """
    from threadpoolctl import threadpool_limits

    backends = backends or gemm.available()
    rng = np.random.default_rng(0)
    seconds = {}
    with threadpool_limits(1, user_api="blas"):
        for name in backends:
            with gemm.using(name):
                for dtype in dtypes:
                    for d in dims:
                        q, k, v = (rng.standard_normal((heads, seq, d)).astype(dtype) for _ in range(3))
                        out, lse = attention_block(q, k, v)
                        dout = rng.standard_normal(out.shape).astype(dtype)
                        for tq, tk in candidates(dtype):
                            tiles = BlockRun(tile_q=tq, tile_k=tk)
                            fwd = _time(functools.partial(attention_block, q, k, v, run=tiles), repeats)
                            bwd = _time(functools.partial(attention_block_backward, dout, q, k, v, out, lse,
                                                          run=tiles), repeats)
                            seconds[(name, dtype, d, tq, tk)] = (fwd, bwd)
                            flops = 4 * d * heads * seq * seq
                            log(f"{name:>5} {dtype:>7} D={d:<4} tiles {tq:>4} x {tk:<4}  fwd {fwd * 1e3:7.1f} ms "
                                f"({flops / fwd / 1e9:5.1f} GFLOP/s)  bwd {bwd * 1e3:7.1f} ms "
                                f"({2.5 * flops / bwd / 1e9:5.1f} GFLOP/s)")

    def best(name, dtype, d, kind):
        rows = {key[3:]: t[kind] for key, t in seconds.items() if key[:3] == (name, dtype, d)}
        tiles = min(rows, key=rows.get)
        return tiles, rows[tiles]

    total = {name: sum(best(name, dt, d, kind)[1] for dt in dtypes for d in dims for kind in (0, 1))
             for name in backends}
    choice = min(total, key=total.get)
    tiles = {kind: {dt: {str(d): list(best(choice, dt, d, i)[0]) for d in dims} for dt in dtypes}
             for i, kind in enumerate(("fwd", "bwd"))}
    entry = {"gemm": choice, "tiles": tiles, "backend_seconds": total,
             "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shape": [heads, seq, seq]}
    if write and cache_path():
        _write(entry)
    return entry


def _write(entry):
    """Store ``entry`` as this machine's, keeping the other machines' entries; atomically replaced."""
    path = cache_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[machine_key()] = entry
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    reread()


def reread():
    """Forget what this process read from the cache (another process, or this one, has just written it)."""
    cached.cache_clear()
    gemm.backend.cache_clear()  # its choice for "auto" came from the cache too
