"""This core's peak rate of fused multiply-adds (float32), measured with a small C loop: the physical limit.

    python -m mpiring.tools.peak

A C program (compiled here with ``cc -O3 -march=native``, so with the widest
vectors the CPU has) runs 12 independent chains of vector FMAs, enough to keep
every FMA unit busy, and times them by the thread's CPU time (a machine shared
with other processes slows the wall clock, not the count of cycles it got).
2 FLOP per FMA lane. None when no C compiler is found. The benchmark prints
every row's GFLOP/s as a fraction of P x this.
"""

import functools
import os
import shutil
import subprocess
import tempfile

__all__ = ["fma_peak_flops", "SOURCE"]

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


if __name__ == "__main__":
    from mpiring.core.machine import cpu_model, vector_extensions

    peak = fma_peak_flops()
    print(f"{cpu_model()} ({vector_extensions()}): "
          + (f"{peak / 1e9:.1f} GFLOP/s float32 FMA peak, one core" if peak else "no C compiler: peak not measured"))
