"""A controlled background load for the benchmark: N child processes that each keep a core busy.

    with busy_load(1):            # one spinning process while the block runs
        time_something()

The spinners are plain interpreters running a loop (no numpy, no MPI), with
``MARKER`` in their command line so that a test or a person can find them in
``/proc``. They end on every way out of the block:

- the block ends, normally or by an exception (KeyboardInterrupt included):
  ``busy_load`` kills and reaps them in its ``finally``;
- the interpreter exits with spinners still running (a generator never closed):
  an ``atexit`` hook kills them;
- the parent dies without running either (C's ``exit()`` in the Ctrl-C handler of
  ``python -m mpiring``, ``MPI_Abort``, SIGKILL): each spinner checks its parent
  every few milliseconds and leaves once it has been orphaned.

Reaped spinners count as this process's children in ``own_cpu_seconds``, so the
benchmark's background-load figure does not mistake them for other processes.
"""

import atexit
import contextlib
import os
import subprocess
import sys

from .probes import child_env

__all__ = ["MARKER", "busy_load", "spinner_pids"]

MARKER = "mpiring-bench-load"

# spins about a millisecond between looks at its parent; leaves once orphaned (reparented). The parent's
# pid comes in argv: read with getppid() at start, it would be init's if the parent died before that.
# One line on stdout says it is running, so that the load is on when the block starts.
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
    """Keep ``n`` (>= 0) extra processes spinning while the block runs; yields their pids."""
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
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if MARKER.encode() in f.read():
                        found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                pass
    return found
