"""One rank fails in every strategy in turn; every rank must end each case in bounded time. One job, many cases.

    mpiexec -n 4 python tests/strategy_fault_job.py --timeout 1.5
    mpiexec -n 16 python tests/strategy_fault_job.py --timeout 3 --cases double_ring:backward grid:split
    mpiexec -n 4 python tests/strategy_fault_job.py --timeout 1.5 --drain 0.25   # each case's drain shortened

A case is ``STRATEGY:WHERE``: the strategy (``STRATEGIES``) and where rank
``--rank`` raises: ``forward`` (its second block in the forward pass,
``block.attend``), ``backward`` (its second block's gradients after a
forward that worked, ``block.grads_of``) or ``split`` (instead of making the
communicators that need MPI's blocking ``Split``: the grid's groups, the
double ring's nodes as MPI places them). Every rank runs every case with
``timeout=--timeout`` on a fresh ``Ring`` and notes what it got and when, from
a common start; the ranks meet in a blocking barrier between cases (all are
alive: the failing rank raised and caught it), so a case in which some rank
never returns hangs the job, and its launcher's limit ends it. Rank 0 prints
one JSON line per case: ``{"case", "seconds": [per rank], "outcomes": [per rank]}``.
"""

import argparse
import dataclasses
import json
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiring
import mpiring.handle
import mpiring.parallel.grid
import mpiring.parallel.strategies
from mpiring.core import block
from mpiring.mpi import waits
from mpiring.plans.checks import backend_problem

STRATEGIES = {"ring": {}, "bidirectional": dict(mode="bidirectional"), "allgather": dict(mode="allgather"),
              "pass-q": dict(rotate="q"), "ulysses": dict(mode="ulysses"),
              "double_ring": dict(mode="double_ring", node_size=2), "grid": dict(ulysses_size=2),
              "sparse": dict(mode="sparse"), "double_ring_mpi_nodes": dict(mode="double_ring")}  # last: Split_type
CASES = [f"{s}:{where}" for s in STRATEGIES if s != "double_ring_mpi_nodes" for where in ("forward", "backward")] \
    + ["grid:split", "double_ring_mpi_nodes:split"]


def _failing(name, rank, after):
    """Make ``block.<name>`` raise on its call number ``after`` (from 0) on this rank; returns the undo."""
    real, calls = getattr(block, name), [0]

    def failing(*args, **kwargs):
        calls[0] += 1
        if calls[0] == after + 1:
            raise RuntimeError(f"injected fault on rank {rank}")
        return real(*args, **kwargs)

    setattr(block, name, failing)
    return lambda: setattr(block, name, real)


def _no_split(rank):
    """Make this rank raise where it would make the communicators MPI can only make with a blocking call."""
    def refuse(*args, **kwargs):
        raise RuntimeError(f"injected fault on rank {rank}")

    table = mpiring.parallel.strategies.STRATEGIES
    saved = mpiring.parallel.grid.grid_comms, table["double_ring"]
    mpiring.parallel.grid.grid_comms = refuse
    # the double ring's placement (nodes_of: Split_type when node_size is not given), as the strategy table holds it
    table["double_ring"] = dataclasses.replace(
        saved[1], place=lambda plan, comm, node_size, *rest: refuse() if node_size is None else plan)

    def undo():
        mpiring.parallel.grid.grid_comms, table["double_ring"] = saved
    return undo


def run_case(comm, case, failing_rank, timeout):
    """``(seconds, outcome)`` of this rank in ``case``, from the start every rank shares (a barrier)."""
    strategy, where = case.split(":")
    rank, P = comm.Get_rank(), comm.Get_size()
    S, H, D = 4 * P, P, 8  # Ulysses splits P heads one each
    rng = np.random.default_rng(0)
    Q, K, V, dO = (rng.standard_normal((1, H, S, D)) for _ in range(4))
    q, k, v, do = (np.ascontiguousarray(mpiring.shard(x, P, rank)) for x in (Q, K, V, dO))
    undo = lambda: None  # noqa: E731
    comm.Barrier()
    start = time.perf_counter()
    try:
        if rank == failing_rank and where == "split":
            undo = _no_split(rank)
        if rank == failing_rank and where == "forward":
            undo = _failing("attend", rank, 1)
        with mpiring.Ring(comm, S, causal=True, timeout=timeout, **STRATEGIES[strategy]) as ring:
            out, lse = ring.forward(q, k, v)
            if where == "backward":
                if rank == failing_rank:
                    undo = _failing("grads_of", rank, 1)
                ring.backward(do, q, k, v, out, lse)
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 -- what each rank gets is the point
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        undo()
    return time.perf_counter() - start, outcome


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=1.5)
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--cases", nargs="*", default=CASES, help=f"default: all ({', '.join(CASES)})")
    parser.add_argument("--drain", type=float, default=waits.DRAIN_SECONDS,
                        help="seconds a rank told of the failure lets its pending transfers complete "
                             f"(default: the library's, {waits.DRAIN_SECONDS:g})")
    args = parser.parse_args()
    waits.DRAIN_SECONDS = args.drain
    comm = MPI.COMM_WORLD
    # the kernel backend's library loaded before the first case's clock starts (torch's import, with
    # MPIRING_KERNEL=torch: 10-15 s for 16 ranks on 2 cores): a case's time is its ring's
    problem = backend_problem()
    if problem:
        raise SystemExit(problem)
    for case in args.cases:
        seconds, outcome = run_case(comm, case, args.rank, args.timeout)
        said = comm.gather((seconds, outcome), root=0)  # blocking: every rank has returned by now
        if comm.Get_rank() == 0:
            print(json.dumps({"case": case, "seconds": [round(s, 2) for s, _ in said],
                              "outcomes": [o for _, o in said]}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
