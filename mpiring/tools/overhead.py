"""The fixed cost of a call: forward + backward through the functions and through a ``Ring`` handle.

    mpiexec -n 2 python -m mpiring.tools.overhead            # S = 64 and 1024, printed as a table

Per call and rank: the whole call's wall time; the ring's own time inside it
(``Record.wall_time``, forward plus backward: from the common start to the
end-of-ring check); and the kernels' time (``Record.compute_time``). The
call's fixed cost is the first minus the second: agreement, communicator
duplicates, the start barrier or the handle's all-reduce, copies, the
threads' limit, freeing, and (on a rank that finished its previous call
first) waiting for the others to arrive: the least over ranks is the call's
own cost, the largest includes that wait. The ring minus the kernels is what the ring spends
waiting: transfers, the merge of the partials, and a faster rank waiting for
a slower one. Printed: the median over the repetitions, the largest over ranks.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiring


def _calls(comm, S, heads, dim, repeats, use_ring):
    """Median (wall, ring, kernel) seconds of forward + backward per call on this rank."""
    rng = np.random.default_rng([S, comm.rank])
    n = len(mpiring.shard_indices(S, comm.size, comm.rank, "zigzag"))
    q, k, v, dout = (rng.standard_normal((1, heads, n, dim)).astype(np.float32) for _ in range(4))
    options = dict(causal=True, layout="zigzag")
    ring = mpiring.Ring(comm, S, **options) if use_ring else None
    walls, rings, kernels = [], [], []
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
        rings.append(forward.wall_time + backward.wall_time)
        kernels.append(forward.compute_time + backward.compute_time)
    if ring is not None:
        ring.close()
    return tuple(float(np.median(x[1:])) for x in (walls, rings, kernels))


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
        print(f"{'S':>6} {'entry':>10} {'call ms':>8} {'ring ms':>8} {'kernels ms':>11} {'fixed cost ms':>14} "
              f"{'(other ranks)':>13} {'ring waits ms':>14}")
    for S in args.sizes:
        for name, use_ring in (("functions", False), ("Ring", True)):
            wall, ring, kernel = _calls(comm, S, args.heads, args.dim, args.repeats, use_ring)
            wall, ring, kernel, most, waits = (comm.allreduce(x, op=MPI.MAX)
                                               for x in (wall, ring, kernel, wall - ring, ring - kernel))
            least = comm.allreduce(wall - ring, op=MPI.MIN)  # the rank the others wait for: the call's own cost
            if comm.rank == 0:
                print(f"{S:>6} {name:>10} {wall * 1e3:>8.2f} {ring * 1e3:>8.2f} {kernel * 1e3:>11.2f} "
                      f"{least * 1e3:>14.2f} {'up to ' + format(most * 1e3, '.2f'):>13} {waits * 1e3:>14.2f}")


if __name__ == "__main__":
    main()
