"""Tuning for this CPU: the GEMM backend and the tile sizes that run the kernels fastest, cached. No MPI.

    python -m mpiring tune            # times the candidates on one core (a minute or two), writes the cache
    python -m mpiring tune --show     # what the cache holds for this machine

The kernels' defaults were measured on one CPU; another CPU, or another
BLAS, may prefer other tiles. ``tune`` times the forward and the backward
kernel of a block (8 heads, 4096 x 4096 tokens, no mask) for each candidate
(backend, tile_q, tile_k) on one core with one BLAS thread, as a rank runs
under ``mpiexec`` with one rank per core, and keeps the fastest. The cache is
a JSON file keyed by what decides the speed (CPU model, NumPy, BLAS, MKL
present or not), so one file serves the different nodes of a cluster that
share a home directory. Where it lives: ``MPIRING_TUNE_CACHE`` (a path, or
``off`` to ignore any cache), else ``$XDG_CACHE_HOME/mpiring/tune.json``,
else ``~/.cache/mpiring/tune.json`` (``mpiring.core.machine`` reads it).

Tiles and backend change only the order of the sums: results agree to
rounding whatever the cache says (``tests/test_tune.py``).
"""

import functools
import json
import os
import tempfile
import time

import numpy as np

from . import gemm
from .kernels import attention_block, attention_block_backward
from .machine import cache_path, cached, machine_key

__all__ = ["tune", "candidates"]


def candidates(dtype):
    """The (tile_q, tile_k) pairs ``tune`` times: score tiles of one head from 256 KiB to 2 MiB."""
    pairs = [(256, 256), (512, 256), (256, 512), (512, 512), (1024, 256), (1024, 512)]  # float32
    return [(tq * 4 // np.dtype(dtype).itemsize, tk) for tq, tk in pairs]  # float64: half the rows


def _time(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def tune(dims=(64, 128), dtypes=("float32",), seq=4096, heads=8, repeats=2, backends=None, write=True,
         log=print):
    """Time every (backend, tiles) candidate on one core; cache and return the choice for this machine.

    Returns ``{"gemm": backend, "tiles": {kind: {dtype: {d: [tq, tk]}}}, "backend_seconds": {...}, ...}``:
    the backend with the least total time over all its best rows, and for it the fastest tiles
    of each kernel, head dim and dtype.
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
                            tiles = {"tile_q": tq, "tile_k": tk}
                            fwd = _time(functools.partial(attention_block, q, k, v, **tiles), repeats)
                            bwd = _time(functools.partial(attention_block_backward, dout, q, k, v, out, lse,
                                                          **tiles), repeats)
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
    cached.cache_clear()
    gemm.backend.cache_clear()  # its choice for "auto" came from the cache too
