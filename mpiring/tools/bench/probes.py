"""What this machine is and can do: its CPU and BLAS, one core's GEMM, exp and FMA rates, memory and CPU time,
and a controlled background load.

    python -m mpiring bench peak          # this core's peak float32 FMA rate

No MPI (the benchmark's child processes import this module).
"""

import atexit
import contextlib
import functools
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
from threadpoolctl import threadpool_info, threadpool_limits

from mpiring.core.tuning import gemm
from mpiring.core.tuning.machine import cpu_model, trim_heap, vector_extensions

from ..cli import command_parser, objects

__all__ = ["cpu_text", "best_seconds", "blas_report", "measure_limits", "limit_seconds", "fma_peak_flops", "peak",
           "peak_parser", "rss_mb", "peak_rss_mb", "reset_peak_rss", "available_mb", "busy_cpu_seconds",
           "own_cpu_seconds", "load_clock", "background_cores", "child_env", "MARKER", "busy_load", "spinner_pids"]


def cpu_text():
    """The CPU model and its vector extensions, as every benchmark names the machine."""
    return f"{cpu_model()} ({vector_extensions()})"


def best_seconds(fn, repeats, clock=time.perf_counter):
    """The fastest of ``repeats`` calls of ``fn`` on ``clock``, after one call to warm up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        fn()
        best = min(best, clock() - start)
    return best


# ---------------------------------------------------------------- BLAS, GEMM and exp on one core


def _blas_pools():
    return [p for p in threadpool_info() if p.get("user_api") == "blas"]


def _tile_gemms(rng, n, d, dtype, mm=None):
    """The two forward GEMMs of one (n x n) attention tile with head dim ``d`` as a function to time;
    ``mm``: a ``mpiring.core.tuning.gemm`` product (None: ``np.matmul``)."""
    q, k = (rng.standard_normal((n, d), dtype=np.float32).astype(dtype) for _ in range(2))
    s, o = np.empty((n, n), dtype), np.empty((n, d), dtype)
    mm = mm or (lambda a, b, out: np.matmul(a, b, out=out))

    def gemms():
        mm(q[None], k.T[None], s[None])
        mm(s[None], k[None], o[None])

    return gemms


def gemm_probe(n=1024, d=64, repeats=5):
    """This process's BLAS: kernel family and single-thread fp32 GFLOP/s on one attention tile's GEMMs."""
    pools = _blas_pools()
    with threadpool_limits(1, user_api="blas"):
        seconds = best_seconds(_tile_gemms(np.random.default_rng(2), n, d, np.float32), repeats)
    return {"arch": pools[0].get("architecture") if pools else None, "gflops": 4 * n * n * d / seconds / 1e9}


def blas_report(check_free=True):
    """BLAS library, version, kernel family and threads; a warning when ``OPENBLAS_CORETYPE`` forces kernels
    other than those OpenBLAS picks by itself (asked of a child interpreter without the variable) and slower."""
    pool = (_blas_pools() or [{}])[0]
    report = {"blas": f"{pool.get('internal_api', 'unknown')} {pool.get('version', '')}".strip(),
              "blas_arch": pool.get("architecture") or "unknown", "blas_threads": pool.get("num_threads", 0),
              "coretype_env": os.environ.get("OPENBLAS_CORETYPE"), "free_arch": None, "warning": None}
    if not (report["coretype_env"] and check_free and pool.get("internal_api") == "openblas"):
        return report
    env = {k: v for k, v in child_env().items() if k != "OPENBLAS_CORETYPE"}
    code = "import json; from mpiring.tools.bench.probes import gemm_probe; print(json.dumps(gemm_probe()))"
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                             check=True).stdout
        free = json.loads(out.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        free = {"arch": None, "gflops": None}
    report["free_arch"] = free["arch"]
    if free["arch"] and free["arch"].lower() != str(report["blas_arch"]).lower():
        forced = gemm_probe()["gflops"]
        speed = f"; one-core GEMM {forced:.0f} GFLOP/s forced vs {free['gflops']:.0f} free" if free["gflops"] else ""
        verdict = ("below what the CPU can do" if not free["gflops"] or free["gflops"] > 1.05 * forced
                   else "not slower on this CPU")
        report["warning"] = (f"OPENBLAS_CORETYPE={report['coretype_env']} forces {report['blas_arch']} kernels; "
                             f"OpenBLAS picks {free['arch']} on this CPU when the variable is unset{speed} "
                             f"(forced kernels: {verdict})")
    return report


def measure_limits(dims, n=1024, repeats=5, dtype=np.float32):
    """One core's rates on an ``n`` x ``n`` tile: ``{d: {"gemm_flops", "exp_per_s", "exp_fn", "peak_flops",
    "gemm_name"}}``.

    The kernels' GEMM backend (``core.tuning.gemm``) on a tile's two forward GEMMs per head dim d; the faster of
    ``np.exp`` and ``np.exp2`` per score; ``peak_flops``: a square 2048 x 2048 product, the fastest GEMM
    this BLAS runs (no attention kernel can beat it: every score costs 4 d GEMM FLOPs).
    """
    rng = np.random.default_rng(1)
    src = (rng.random((n, n), dtype=np.float32) * -16).astype(dtype)
    dst = np.empty_like(src)
    with threadpool_limits(1, user_api="blas"):
        mm = gemm.product()  # the GEMMs the kernels use with one thread: NumPy's or MKL's
        rates = {name: n * n / best_seconds(lambda fn=fn: fn(src, out=dst), repeats)
                 for name, fn in (("exp", np.exp), ("exp2", np.exp2))}
        exp_fn = max(rates, key=rates.get)
        big = rng.standard_normal((2048, 2048), dtype=np.float32)
        square = np.empty_like(big)
        peak = 2 * 2048 ** 3 / best_seconds(lambda: mm(big[None], big[None], square[None]), max(2, repeats // 2))
        return {d: {"gemm_flops": 4 * n * n * d / best_seconds(_tile_gemms(rng, n, d, dtype, mm), repeats),
                    "exp_per_s": rates[exp_fn], "exp_fn": exp_fn, "peak_flops": peak,
                    "gemm_name": "MKL" if mm is gemm.gemm_mkl else "np.matmul"} for d in dims}


def limit_seconds(limits, cfg, pairs):
    """Time of the matmul+exp limit for ``pairs`` visible (query, key) pairs per head of benchmark row ``cfg``."""
    lim = limits[cfg.D]
    per_pair = (14 if cfg.backward else 4) * cfg.D / lim["gemm_flops"] + (2 if cfg.backward else 1) / lim["exp_per_s"]
    return cfg.B * cfg.H * pairs * per_pair


# ---------------------------------------------------------------- the FMA peak: the physical limit

# 12 independent chains of 16-lane float32 FMAs (enough to keep every FMA unit busy), timed in the thread's CPU
# time; compiled with -march=native, so with the widest vectors the CPU has. 2 FLOP per lane and FMA.
SOURCE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
typedef float v16 __attribute__((vector_size(64)));
int main(int argc, char **argv) {
  long iters = argc > 1 ? atol(argv[1]) : 20000000L;
  v16 a[12], x, y;
  for (int i = 0; i < 16; i++) { x[i] = 1.0f + 1e-7f * i; y[i] = 1e-8f; }
  for (int j = 0; j < 12; j++) a[j] = x * (float)j;
  struct timespec t0, t1;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
  for (long n = 0; n < iters; n++) {
    for (int j = 0; j < 12; j++) a[j] = a[j] * x + y;
    __asm__ volatile("" : "+x"(x));
  }
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
  float s = 0;
  for (int j = 0; j < 12; j++) for (int i = 0; i < 16; i++) s += a[j][i];
  double sec = (t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec);
  printf("%.9g %.9g %g\n", sec, 2.0 * 16 * 12 * iters / sec, s);
  return 0;
}
"""


@functools.cache
def fma_peak_flops(repeats=5, iters=20_000_000):
    """Float32 FLOP/s of one core at its peak FMA rate (the best of ``repeats`` runs), or None without a compiler."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "fma.c"), os.path.join(tmp, "fma")
        with open(src, "w") as f:
            f.write(SOURCE)
        try:
            subprocess.run([cc, "-O3", "-march=native", src, "-o", exe], check=True, capture_output=True,
                           timeout=60)
            runs = [subprocess.run([exe, str(iters)], check=True, capture_output=True, text=True, timeout=60)
                    for _ in range(repeats)]
        except (subprocess.SubprocessError, OSError):
            return None
    return max(float(r.stdout.split()[1]) for r in runs)


def peak_parser():
    return command_parser("bench peak", peak)


def peak(comm=None, args=None):
    """This core's peak float32 FMA rate, measured with a small C loop: the physical limit."""
    peak_parser().parse_args(args)
    flops = fma_peak_flops()
    print(f"{cpu_text()}: " + (f"{flops / 1e9:.1f} GFLOP/s float32 FMA peak, one core" if flops
                               else "no C compiler: peak not measured"))
    return 0


# ---------------------------------------------------------------- memory and CPU time (Linux /proc first)


def _status_mb(field):
    """A ``Vm...`` field of /proc/self/status in MiB (off Linux: the peak RSS ``resource`` knows)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb():
    """Current resident set size in MiB."""
    return _status_mb("VmRSS")


def peak_rss_mb():
    """Peak resident set size since the last ``reset_peak_rss`` (or process start), MiB."""
    return _status_mb("VmHWM")


def reset_peak_rss():
    """Give freed heap back to the OS and reset the peak (Linux: clear_refs 5). True if reset."""
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def available_mb():
    """MemAvailable of /proc/meminfo in MiB (None if unknown)."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return None


def busy_cpu_seconds():
    """CPU seconds all processes of the machine have used so far (/proc/stat; None off Linux)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds():
    """CPU seconds of this process and its finished children."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def load_clock(comm):
    """Now, the machine's busy CPU seconds and the ranks' own (and their children's): for ``background_cores``."""
    return time.perf_counter(), busy_cpu_seconds(), sum(objects(comm, own_cpu_seconds()))


def background_cores(comm, clock):
    """Cores kept busy by processes other than the ranks (and their children) since ``clock`` (None off Linux)."""
    start, busy, own = clock
    own = sum(objects(comm, own_cpu_seconds())) - own
    now = busy_cpu_seconds()
    if busy is None or now is None:
        return None
    return max(0.0, (now - busy - own) / (time.perf_counter() - start))


def child_env(**extra):
    """This environment without the MPI launcher's variables (a child must not join the job), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_"))}
    env.update(extra)
    return env


def child_json(script, job, threads, timeout, *argv):
    """What the file ``script`` prints last (a JSON line), run by this Python outside MPI with ``threads`` threads
    and ``job`` as JSON on its stdin; None if it failed or printed none."""
    env = child_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        done = subprocess.run([sys.executable, os.path.abspath(script), *argv], input=json.dumps(job), env=env,
                              capture_output=True, text=True, timeout=timeout)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return None


# ---------------------------------------------------------------- a controlled background load

MARKER = "mpiring-bench-load"  # in every spinner's command line, so that a test or a person finds them in /proc

# A plain interpreter in a loop (no numpy, no MPI). It says it runs, so that the load is on when the block starts,
# and leaves once orphaned (the parent's pid comes in argv: read with getppid() at start, it would be init's if
# the parent died before that), so no spinner outlives a parent killed without its finally or atexit.
SPINNER = ("import os, sys\n"
           "parent = int(sys.argv[1])\n"
           "print('spinning', flush=True)\n"
           "sys.stdout.close()\n"
           "while os.getppid() == parent:\n"
           "    for _ in range(20000):\n"
           "        pass\n"
           f"# {MARKER}\n")

_live = set()  # spinners started and not yet reaped, for the atexit hook


def _stop(procs):
    """Kill and reap ``procs`` (those already gone too)."""
    for proc in procs:
        with contextlib.suppress(OSError):
            proc.kill()
    for proc in procs:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            proc.wait(timeout=10)
        _live.discard(proc)


@atexit.register
def _stop_all():
    _stop(list(_live))


@contextlib.contextmanager
def busy_load(n):
    """Keep ``n`` (>= 0) extra processes spinning while the block runs; yields their pids.

    Reaped spinners count as this process's children in ``own_cpu_seconds``, not as other processes' load.
    """
    if n < 0:
        raise ValueError(f"busy_load needs n >= 0, got {n}")
    procs = []
    try:
        for _ in range(n):
            proc = subprocess.Popen([sys.executable, "-c", SPINNER, str(os.getpid())], stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env())
            procs.append(proc)
            _live.add(proc)
        for proc in procs:  # each says it runs (or ends: EOF); no block starts before its load is there
            proc.stdout.readline()
            proc.stdout.close()
        yield [proc.pid for proc in procs]
    finally:
        _stop(procs)


def spinner_pids():
    """Pids of the spinners running on this machine, anyone's (Linux /proc; [] elsewhere)."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            with contextlib.suppress(OSError), open(f"/proc/{entry}/cmdline", "rb") as f:  # gone, or not ours
                if MARKER.encode() in f.read():
                    found.append(int(entry))
    return found
