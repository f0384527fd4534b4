"""BLAS threads inside a library call: shared out among the ranks on a node, restored afterwards.

Ranks that share a node's cores and each let BLAS start a thread per core
oversubscribe them (docs/performance.md §9). So every call of ``ring_attention``
(and every ``Ring`` call) limits BLAS, for its own duration only, to the
node's cores divided among its ranks: one thread each when ranks are at least
as many as cores. ``threads=`` overrides that (an int), or leaves BLAS alone
(None). No MPI here: the ranks per node come from the processor names the
agreement gathers, and from the launcher's environment.
"""

import contextlib
import functools
import os
from collections import Counter

__all__ = ["threads_problem", "threads_for", "node_threads", "limited", "blas_threads", "cores", "launcher_local_ranks"]


def cores():
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def launcher_local_ranks():
    """Ranks of this job on this node, as MPICH's Hydra or Open MPI's launcher tell them (1 if neither does)."""
    local = os.environ.get("MPI_LOCALNRANKS") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE") or "1"
    try:
        return max(1, int(local))
    except ValueError:
        return 1


def threads_problem(threads):
    """Why ``threads`` is not a valid setting, or None."""
    if threads is None or (isinstance(threads, str) and threads == "auto"):
        return None
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        return f"threads must be 'auto', a positive int (BLAS threads per rank) or None (leave BLAS alone); " \
               f"got {threads!r}"
    return None


def threads_for(threads, hosts, rank):
    """BLAS threads for this rank's calls, or None to leave BLAS as it is.

    ``threads``: an int is used as it is, None leaves BLAS alone; "auto": when
    several ranks run on this node (the communicator's ranks with this rank's
    processor name in ``hosts``, or the launcher's count of the job's ranks
    here, whichever is larger), this process's cores divided among them, at
    least one; a rank alone on its node is left alone.
    """
    if not isinstance(threads, str):
        return threads
    local = max(Counter(hosts)[hosts[rank]], launcher_local_ranks())
    return None if local <= 1 else max(1, cores() // local)


def node_threads():
    """``threads_for("auto", ...)`` for a call without a communicator: the launcher's count of ranks here."""
    return threads_for("auto", ["this node"], 0)


@functools.cache
def _controller():
    from threadpoolctl import ThreadpoolController  # the BLAS libraries loaded now (numpy's): found once

    return ThreadpoolController()


@contextlib.contextmanager
def limited(threads):
    """BLAS limited to ``threads`` threads inside the block (None: unchanged), restored afterwards."""
    if threads is None:
        yield
        return
    with _controller().limit(limits=threads, user_api="blas"):
        yield


def blas_threads():
    """Threads NumPy's BLAS uses now (the largest count of the BLAS libraries loaded when first asked)."""
    return max((lib.get_num_threads() for lib in _controller().select(user_api="blas").lib_controllers), default=1)
