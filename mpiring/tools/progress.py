"""A ring step counter on the terminal, shown only when output reaches one (also through mpiexec)."""

import os
import sys
import time

__all__ = ["stdout_is_terminal", "Progress"]


def stdout_is_terminal(stream=None):
    """True if output reaches a terminal, also through mpiexec (which pipes ranks' output).

    Under mpiexec a rank's stdout is a pipe to the launcher; on Linux the
    launcher's own stdout is looked up in /proc, so progress shows when the
    user runs mpiexec in a terminal and stays quiet when output is redirected.
    """
    stream = sys.stdout if stream is None else stream
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    pid = os.getppid()
    for _ in range(4):  # rank -> proxy -> launcher
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            name = stat[stat.index("(") + 1:stat.rindex(")")]
            if any(k in name for k in ("mpiexec", "mpirun", "prterun", "orterun", "srun")):
                return os.readlink(f"/proc/{pid}/fd/1").startswith(("/dev/pts/", "/dev/tty"))
            pid = int(stat[stat.rindex(")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


class Progress:
    """A one-line step counter, redrawn at most every ``interval`` seconds.

    Pass it as ``on_step`` on rank 0: it costs a clock read per step. In a
    ring no rank gets more than a step ahead of its neighbour, so rank 0's
    count is the ring's. Quiet unless ``enabled`` (default: output is a terminal).
    """

    def __init__(self, label="ring step", enabled=None, stream=None, interval=0.2):
        self.stream = sys.stdout if stream is None else stream
        self.enabled = stdout_is_terminal(self.stream) if enabled is None else enabled
        self.label, self.interval = label, interval
        self.start = time.perf_counter()
        self._last = -float("inf")
        self._drawn = False

    def __call__(self, done, total):
        if not self.enabled:
            return
        now = time.perf_counter()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        self.stream.write(f"\r{self.label} {done}/{total}  {now - self.start:6.1f} s")
        self.stream.flush()
        self._drawn = True

    def close(self):
        """Erase the line so that the report starts clean."""
        if self._drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._drawn = False
