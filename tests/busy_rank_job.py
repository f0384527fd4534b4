"""One rank busy between two ring calls (an evaluation, a checkpoint) for longer than the old 60 s default.

    mpiexec -n 2 python tests/busy_rank_job.py --sleep 75

Rank ``--rank`` sleeps ``--sleep`` seconds between two forward + backward
calls of a ``Ring``, then before a call of ``ring_attention``; every other
rank waits in the call's entry. With timeout="auto" every call must succeed
(before issue 33 the waiting ranks raised ``CommTimeout: ... agreement not
complete after 60 s``); the waiting ranks log on stderr whom they wait for.
Each rank prints its outcome and how long its calls took.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpiring


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sleep", type=float, default=75.0)
    parser.add_argument("--rank", type=int, default=1, help="the busy rank")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    S = 64 * comm.size
    rng = np.random.default_rng(0)
    Q, K, V, dOut = (rng.standard_normal((1, S, 4, 16)) for _ in range(4))
    outcome = "ok"
    try:
        with mpiring.Ring(comm, S, causal=True, layout="zigzag", seq_axis=-3) as ring:
            q, k, v, dout = (ring.shard(x) for x in (Q, K, V, dOut))
            out, lse = ring.forward(q, k, v)
            ring.backward(dout, q, k, v, out, lse)
            if comm.rank == args.rank:
                time.sleep(args.sleep)  # the busy rank's evaluation
            start = time.perf_counter()
            again, lse = ring.forward(q, k, v)
            ring.backward(dout, q, k, v, again, lse)
            waited = time.perf_counter() - start
            assert np.array_equal(out, again)
            if comm.rank == args.rank:
                time.sleep(args.sleep)  # and its checkpoint, before a call of the function
            start = time.perf_counter()
            plain, _ = mpiring.ring_attention(q, k, v, comm, causal=True, layout="zigzag", seq_axis=-3)
            assert np.array_equal(out, plain)
            outcome = f"ok: the Ring's call took {waited:.1f} s, the function's {time.perf_counter() - start:.1f} s"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(f"rank {comm.rank}: {outcome}", flush=True)


if __name__ == "__main__":
    main()
