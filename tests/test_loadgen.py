"""The benchmark's background load (mpiring.tools.bench.probes): spinners that never outlive their parent.

    python -m pytest -q tests/test_loadgen.py

Each test keeps a spinner alive for a fraction of a second: little CPU taken from anything else.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from mpiring.tools.bench.probes import MARKER, busy_load, spinner_pids

needs_proc = pytest.mark.skipif(not os.path.isdir("/proc"), reason="no /proc")


def _gone(pids, limit=5.0):
    """True once none of ``pids`` is a running spinner (waits up to ``limit`` seconds)."""
    end = time.perf_counter() + limit
    while time.perf_counter() < end:
        if not set(pids) & set(spinner_pids()):
            return True
        time.sleep(0.05)
    return False


def _child(code):
    """Run ``code`` in a fresh interpreter; the pids it printed (one per line)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return [int(line) for line in done.stdout.split()]


@needs_proc
def test_spinners_run_in_the_block_and_end_with_it():
    with busy_load(2) as pids:
        assert len(pids) == 2 and set(pids) <= set(spinner_pids())
        assert all(MARKER.encode() in open(f"/proc/{p}/cmdline", "rb").read() for p in pids)
    assert _gone(pids, limit=0.5)


@needs_proc
def test_an_exception_in_the_block_ends_them():
    with pytest.raises(RuntimeError), busy_load(1) as pids:
        raise RuntimeError("boom")
    assert _gone(pids, limit=0.5)


def test_no_load_starts_nothing_and_negative_is_refused():
    with busy_load(0) as pids:
        assert pids == []
    with pytest.raises(ValueError, match="n >= 0"), busy_load(-1):
        pass


@needs_proc
def test_the_atexit_hook_ends_spinners_left_running():
    pids = _child("""
        from mpiring.tools.bench.probes import busy_load
        block = busy_load(1)
        print(*block.__enter__(), flush=True)
        import mpiring.tools.bench.probes as g
        g._keep = block  # never closed: only the atexit hook can end the spinner
    """)
    assert len(pids) == 1 and _gone(pids)


@needs_proc
def test_an_orphaned_spinner_leaves_on_its_own():
    """The parent ends without finally or atexit (os._exit, as on Ctrl-C; or MPI_Abort, SIGKILL)."""
    pids = _child("""
        import os
        from mpiring.tools.bench.probes import busy_load
        with busy_load(1) as pids:
            print(*pids, flush=True)
            os._exit(0)
    """)
    assert len(pids) == 1 and _gone(pids)
