"""One rank raises mid-ring while its transfers (16 KiB and more) are in flight; the others must raise CommTimeout.

    mpiexec -n 3 python tests/abandon_job.py forward|backward

Cancelling a pending send of 8 KiB or more crashed MPICH (SIGSEGV on the live
ranks); the ring now abandons pending requests instead (comm.ABANDONED).
"""

import sys

import numpy as np
from mpi4py import MPI

import mpiring
from mpiring.core import block


def main(which):
    world = MPI.COMM_WORLD
    rank, P = world.Get_rank(), world.Get_size()
    rng = np.random.default_rng(0)
    Q, K, V, dO = (rng.standard_normal((1, 4, 256 * P, 32)) for _ in range(4))
    q, k, v, do = (np.ascontiguousarray(mpiring.shard(x, P, rank)) for x in (Q, K, V, dO))
    out, lse = mpiring.ring_attention(q, k, v, world, timeout=2)
    if rank == 1:  # its second block raises, while K/V (and dK/dV) transfers are posted
        name = "attend" if which == "forward" else "grads_of"
        real, calls = getattr(block, name), [0]

        def failing(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("injected")
            return real(*args, **kwargs)

        setattr(block, name, failing)
    try:
        if which == "forward":
            mpiring.ring_attention(q, k, v, world, timeout=2)
        else:
            mpiring.ring_attention_backward(do, q, k, v, out, lse, world, timeout=2)
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 -- what each rank gets is the point
        outcome = type(exc).__name__
    sys.stdout.write(f"rank {rank}: {outcome}\n")  # one write: the launcher forwards it whole
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
