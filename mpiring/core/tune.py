"""Tuning for this CPU: the kernel backend, GEMM backend and tile sizes that run a block fastest, cached. No MPI.

    python -m mpiring bench tune            # times the candidates on one core (under a minute), writes the cache
    python -m mpiring bench tune --show     # what the cache holds for this machine

The kernels' defaults were measured on one CPU; another CPU, or another
BLAS, may prefer other tiles. ``tune`` times the forward and the backward
kernel of a block (8 heads, 2048 x 2048 tokens, no mask) for each candidate
(GEMM backend, tile_q, tile_k) on one core with one BLAS thread, as a rank runs
under ``mpiexec`` with one rank per core, and keeps the fastest. Then it times
each kernel backend (``mpiring.core.backends``: the NumPy kernel so tuned,
PyTorch's flash-attention ops when installed) as the ring calls it (K/V in the
form the ring keeps for that backend, merged into float64 accumulators) and keeps the fastest
as the ``kernel`` that "auto" picks: another backend only where it measured faster.
Times are CPU seconds of the process (every candidate runs one thread), so
other jobs on the machine disturb the choice less. The cache is a JSON file
keyed by what decides the speed (CPU model, NumPy, BLAS, MKL present or not),
so one file serves the different nodes of a cluster that share a home
directory. Where it lives: ``MPIRING_TUNE_CACHE`` (a path, or ``off`` to
ignore any cache), else ``$XDG_CACHE_HOME/mpiring/tune.json``,
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

from . import backends as kernel_backends
from . import gemm
from .kernels import attention_block, attention_block_backward
from .machine import cache_path, cached, machine_key
from .tiles import pad_ones

__all__ = ["tune", "candidates", "reread", "untuned"]


def candidates(dtype):
    """The (tile_q, tile_k) pairs ``tune`` times: score tiles of one head from 256 KiB to 1 MiB.

    (256 x 512 and 1024 x 512 were dropped: never the fastest on the Xeon or the EPYC, docs/performance.md §14.)"""
    pairs = [(256, 256), (512, 256), (512, 512), (1024, 256)]  # float32
    return [(tq * 4 // np.dtype(dtype).itemsize, tk) for tq, tk in pairs]  # float64: half the rows


def _time(fn, repeats):
    """Fastest of ``repeats`` calls, in this process's CPU seconds (one thread: a machine shared with other jobs
    stretches the wall clock 2-5x, the CPU time much less), after one untimed call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def tune(dims=(64, 128), dtypes=("float32",), seq=2048, heads=8, repeats=2, backends=None, write=True,
         log=print, kernels=None):
    """Time every (backend, tiles) candidate on one core; cache and return the choice for this machine.

    Returns ``{"gemm": backend, "tiles": {kind: {dtype: {d: [tq, tk]}}}, "backend_seconds": {...},
    "kernel": name, "kernel_seconds": {...}, ...}``: the GEMM backend with the least total time over all
    its best rows, for it the fastest tiles of each kernel, head dim and dtype, and the fastest kernel
    backend (``kernels``: those to time, default every one available) with those.
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
    kernel_seconds = _time_kernels(kernels or kernel_backends.available(), choice, tiles, dims, dtypes, seq, heads,
                                   repeats, rng, log)
    kernel = min(kernel_seconds, key=kernel_seconds.get)
    entry = {"gemm": choice, "tiles": tiles, "backend_seconds": total, "kernel": kernel,
             "kernel_seconds": kernel_seconds,
             "measured": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "shape": [heads, seq, seq]}
    if write and cache_path():
        _write(entry)
    return entry


def _time_kernels(names, gemm_name, tiles, dims, dtypes, seq, heads, repeats, rng, log):
    """Seconds of each kernel backend over the dims and dtypes, forward and backward, as the ring calls them."""
    from threadpoolctl import threadpool_limits

    seconds = dict.fromkeys(names, 0.0)
    with threadpool_limits(1, user_api="blas"), gemm.using(gemm_name):
        for dtype in dtypes:
            for d in dims:
                q, k, v = (rng.standard_normal((heads, seq, d)).astype(dtype) for _ in range(3))
                kt, vt = pad_ones(k), pad_ones(v)
                acc = (np.zeros((heads, seq, d)), np.full((heads, seq), -np.inf))
                out, lse = attention_block(q, k, v)
                dout = rng.standard_normal(out.shape).astype(dtype)
                for name in names:
                    fwd_tiles = dict(zip(("tile_q", "tile_k"), tiles["fwd"][dtype][str(d)]))
                    bwd_tiles = dict(zip(("tile_q", "tile_k"), tiles["bwd"][dtype][str(d)]))
                    with kernel_backends.using(name):
                        padded = kernel_backends.takes_padded()  # K/V in the form the ring keeps for it
                        fwd = _time(functools.partial(kernel_backends.attention_block, q, *((kt, vt) if padded
                                                      else (k, v)), padded=padded, into=acc, **fwd_tiles), repeats)
                        bwd = _time(functools.partial(kernel_backends.attention_block_backward, dout, q, k, v, out,
                                                      lse, **bwd_tiles), repeats)
                    seconds[name] += fwd + bwd
                    flops = 4 * d * heads * seq * seq
                    log(f"kernel {name:>5} {dtype:>7} D={d:<4} fwd {fwd * 1e3:7.1f} ms ({flops / fwd / 1e9:5.1f} "
                        f"GFLOP/s)  bwd {bwd * 1e3:7.1f} ms ({2.5 * flops / bwd / 1e9:5.1f} GFLOP/s)")
    return seconds


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
    gemm.backend.cache_clear()  # their choices for "auto" came from the cache too
    kernel_backends.backend.cache_clear()


def untuned():
    """Whether "auto" would pick a kernel backend without a measurement: more than one installed, the choice
    "auto", a tuning cache in use and no entry in it for this machine (``python -m mpiring bench tune`` makes one)."""
    return (kernel_backends.choice() == "auto" and cache_path() is not None and "kernel" not in cached()
            and len(kernel_backends.available()) > 1)
