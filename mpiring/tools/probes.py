"""What the machine says about this process: memory (RSS, its peak, what is free) and CPU time.

Linux /proc first; elsewhere ``resource`` where it has an answer, else None.
"""

import os
import resource

from ..core.machine import trim_heap

__all__ = ["rss_mb", "peak_rss_mb", "reset_peak_rss", "available_mb", "busy_cpu_seconds", "own_cpu_seconds",
           "child_env"]


def _status_kb(field):
    """A ``Vm...`` field of /proc/self/status in kB, or None off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _resident_mb(field):
    kb = _status_kb(field)
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024


def rss_mb():
    """Current resident set size in MiB."""
    return _resident_mb("VmRSS")


def peak_rss_mb():
    """Peak resident set size since the last ``reset_peak_rss`` (or process start), MiB."""
    return _resident_mb("VmHWM")


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
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
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


def child_env(**extra):
    """This environment without the MPI launcher's variables (a child must not join the job), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "OMPI_", "HYDRA_", "MPI_"))}
    env.update(extra)
    return env
