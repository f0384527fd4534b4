"""The fixed cost of a call: forward + backward through the functions and through a ``Ring`` handle.

    mpiexec -n 2 python -m mpiring.tools.overhead            # S = 64 and 1024, printed as a table

Per call, each rank's wall time minus the time it spent in the kernels
(``Record.compute_time``) is the call's overhead: agreement, communicator
duplicates, barriers, copies, the threads' limit and the transfers' waits.
The median over the repetitions and the maximum over ranks is printed.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiring


def _calls(comm, S, heads, dim, repeats, use_ring):
    """Median (wall, kernel) seconds of forward + backward per call on this rank."""
    rng = np.random.default_rng([S, comm.rank])
    n = len(mpiring.shard_indices(S, comm.size, comm.rank, "zigzag"))
    q, k, v, dout = (rng.standard_normal((1, heads, n, dim)).astype(np.float32) for _ in range(4))
    options = dict(causal=True, layout="zigzag")
    ring = mpiring.Ring(comm, S, **options) if use_ring else None
    walls, kernels = [], []
    for _ in range(repeats + 1):  # the first call warms up
        forward, backward = mpiring.Record(), mpiring.Record()
        comm.Barrier()
        start = time.perf_counter()
        if use_ring:
            out, lse = ring.forward(q, k, v, record=forward)
            ring.backward(dout, q, k, v, out, lse, record=backward)
        else:
            out, lse = mpiring.ring_attention(q, k, v, comm, record=forward, **options)
            mpiring.ring_attention_backward(dout, q, k, v, out, lse, comm, record=backward, **options)
        walls.append(time.perf_counter() - start)
        kernels.append(forward.compute_time + backward.compute_time)
    if ring is not None:
        ring.close()
    return float(np.median(walls[1:])), float(np.median(kernels[1:]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.rank == 0:
        print(f"forward + backward per call, P={comm.size}, H={args.heads}, D={args.dim}, fp32, causal zigzag; "
              f"median of {args.repeats}, slowest rank")
        print(f"{'S':>6} {'entry':>10} {'wall ms':>9} {'kernels ms':>11} {'overhead ms':>12}")
    for S in args.sizes:
        for name, use_ring in (("functions", False), ("Ring", True)):
            wall, kernel = _calls(comm, S, args.heads, args.dim, args.repeats, use_ring)
            wall, over = comm.allreduce(wall, op=MPI.MAX), comm.allreduce(wall - kernel, op=MPI.MAX)
            if comm.rank == 0:
                print(f"{S:>6} {name:>10} {wall * 1e3:>9.2f} {(wall - over) * 1e3:>11.2f} {over * 1e3:>12.2f}")


if __name__ == "__main__":
    main()
