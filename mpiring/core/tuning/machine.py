"""This machine: where Intel MKL's library is, and what ``python -m mpiring bench tune`` cached for this CPU. No MPI.

The tuning cache is read here, below the kernels and GEMMs that use its
choices (``tiles.default_tiles``, ``gemm.backend``); ``mpiring.core.tuning.tune``
measures the candidates and writes it. Where it lives: ``MPIRING_TUNE_CACHE``
(a path, or ``off`` to ignore any cache), else
``$XDG_CACHE_HOME/mpiring/tune.json``, else ``~/.cache/mpiring/tune.json``.
"""

import contextlib
import ctypes.util
import functools
import glob
import json
import os
import platform
import sys
import threading

import numpy as np

__all__ = ["mkl_library", "cache_path", "machine_key", "cached", "cached_choice", "cached_tiles", "Choice",
           "cpu_model", "cpu_vendor", "vector_extensions", "numpy_exp2_vectorized", "trim_heap", "one_trim"]


def mkl_library():
    """Path of MKL's ``libmkl_rt`` (the ``mkl`` wheel puts it in the environment's lib/), or None."""
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        found = sorted(glob.glob(os.path.join(prefix, "lib", "libmkl_rt.so*")))
        if found:
            return found[0]
    return ctypes.util.find_library("mkl_rt")


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None (another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_TRIMS = threading.local()  # this thread's open ``one_trim`` scopes, and whether a trim waits for their end


def trim_heap():
    """Give the C heap's free memory back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere).

    Inside ``one_trim()`` the trim waits for the scope's end.
    """
    if getattr(_TRIMS, "depth", 0):
        _TRIMS.pending = True
        return
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@contextlib.contextmanager
def one_trim():
    """The ``trim_heap`` calls made inside, made once when the scope ends (this thread's).

    For a loop of torch blocks whose outputs the heap can keep and reuse between blocks: a trim after each
    block gives their pages back only for the next block to fault them in again (docs/performance.md §23).
    """
    _TRIMS.depth = getattr(_TRIMS, "depth", 0) + 1
    try:
        yield
    finally:
        _TRIMS.depth -= 1
        if not _TRIMS.depth and getattr(_TRIMS, "pending", False):
            _TRIMS.pending = False
            trim_heap()


def cache_path():
    """The cache file's path, or None when ``MPIRING_TUNE_CACHE=off``."""
    env = os.environ.get("MPIRING_TUNE_CACHE")
    if env:
        return None if env.lower() in ("off", "none", "0") else env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "mpiring", "tune.json")


def _cpuinfo(*fields):
    """The value of the first line of /proc/cpuinfo that starts with one of ``fields``, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(fields):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model():
    """This CPU's model name, as /proc/cpuinfo (or the platform) gives it."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_vendor():
    """This CPU's vendor as /proc/cpuinfo gives it ("GenuineIntel", "AuthenticAMD", ...; "" if unknown)."""
    return _cpuinfo("vendor_id") or ""


# the vector extensions that decide a kernel's speed, as /proc/cpuinfo names them (x86 flags, Arm features)
VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_fp16",
                "amx_tile", "asimd", "asimdhp", "sve", "sve2", "bf16", "i8mm")


def vector_extensions():
    """This CPU's vector extensions among ``VECTOR_FLAGS``, e.g. "avx avx2 fma avx512f ..." ("" if unknown)."""
    have = set((_cpuinfo("flags", "Features") or "").split())
    return " ".join(flag for flag in VECTOR_FLAGS if flag in have)


@functools.cache
def numpy_exp2_vectorized():
    """Whether NumPy runs float32 ``exp2`` with a SIMD loop here, not its baseline one (NumPy 2's x86 wheels
    have one for AVX-512 only; docs/performance.md §19). NumPy's own report
    (``numpy.lib.introspect``), else whether the CPU has AVX-512 (NumPy before 2.0)."""
    try:
        from numpy.lib.introspect import opt_func_info

        loops = opt_func_info(func_name="^exp2$", signature="float32")["exp2"].values()
        return any(not loop["current"].startswith("baseline") for loop in loops)
    except (ImportError, KeyError, TypeError, AttributeError):
        return "avx512f" in vector_extensions().split()


@functools.cache
def machine_key():
    """What the fastest choice depends on: CPU model, NumPy's version and BLAS, whether MKL is installed.

    The same whatever this process has loaded so far: the MKL that ``core.tuning.gemm`` loads (or not, as the cache
    says) is left out of the BLAS list, so the key that found the cache is the key the cache was written under.
    """
    from threadpoolctl import threadpool_info

    mkl = mkl_library()
    ours = os.path.realpath(mkl) if mkl else None
    blas = sorted(f"{p.get('internal_api')} {p.get('version')} {p.get('architecture')}"
                  for p in threadpool_info()
                  if p.get("user_api") == "blas" and os.path.realpath(p.get("filepath", "")) != ours)
    return " | ".join([cpu_model(), f"numpy {np.__version__}", *blas, "mkl" if mkl else "no mkl"])


@functools.cache
def cached():
    """This machine's entry of the cache ({} when there is none, or the cache is off or unreadable)."""
    path = cache_path()
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f).get(machine_key(), {})
    except (OSError, ValueError, AttributeError):
        return {}


def cached_choice(name):
    """The cached value of ``name`` (e.g. "gemm") for this machine, or None."""
    return cached().get(name)


def cached_tiles(kind, d, dtype):
    """Cached (tile_q, tile_k) of the ``kind`` ("fwd"/"bwd") kernel for head dim ``d`` and ``dtype``, or None.

    A head dim that was not tuned takes the nearest one that was.
    """
    table = cached().get("tiles", {}).get(kind, {}).get(np.dtype(dtype).name)
    if not table:
        return None
    near = min(table, key=lambda k: (abs(int(k) - d), int(k)))
    tq, tk = table[near]
    return int(tq), int(tk)


class Choice:
    """One process-wide choice among named backends (the GEMMs', the block kernel's).

    It starts from the environment variable ``env`` ("auto" when unset); ``set``
    and ``using`` change it. ``current()`` names the backend in use: the chosen
    one, or for "auto" the tuning cache's entry ``key`` for this machine when
    that is ``available()`` here (``key`` None: no cache entry), else
    ``fallback()``, which answers without loading a library. A name that is
    not a backend raises ValueError, from ``set`` or at the first ``current()``.
    """

    def __init__(self, what, env, names, available, missing, key, fallback):
        self.what, self.env, self.names, self.key = what, env, tuple(names), key
        self._available, self._missing, self._fallback = available, missing, fallback
        self.choice = os.environ.get(env, "auto")
        self.current = functools.cache(self._current)  # cleared by ``set`` and by a new tuning cache

    def check(self, name):
        if name not in self.names + ("auto",):
            raise ValueError(f"{self.what} backend must be one of {self.names + ('auto',)}, not {name!r} ({self.env})")
        if name not in ("auto", "numpy") and name not in self._available():  # numpy: always, nothing to load
            raise ValueError(self._missing(name))

    def set(self, name):
        self.check(name)
        self.choice = name
        self.current.cache_clear()

    @contextlib.contextmanager
    def using(self, name):
        """``set(name)`` inside a ``with`` block; the choice before it is restored after."""
        saved = self.choice
        self.set(name)
        try:
            yield
        finally:
            self.set(saved)

    def _current(self):
        self.check(self.choice)
        if self.choice != "auto":
            return self.choice
        cached = cached_choice(self.key) if self.key else None
        return cached if cached and cached in self._available() else self._fallback()
