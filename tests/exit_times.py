"""Time to exit when one rank misbehaves, with the library's default timeout ("auto").

    python tests/exit_times.py            # the table of docs/reliability.md (about 10 minutes)
    python tests/exit_times.py --case raise

Each case launches ``mpiexec -n 3`` on a small causal ring (``_job`` below, run
in the child) where rank 1 misbehaves, and reports how long the job took to
end and what each rank said. Nobody passes ``timeout=``: the default must end
every case. Not part of the test suite (the default waits are a minute long);
tests/test_faults.py checks the same paths with short timeouts.
"""

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from launch import clean_env, mpiexec_argv  # noqa: E402

CASES = {
    "raise": "rank 1 raises in its second block",
    "exit": "rank 1 calls sys.exit(3) in its second block",
    "comm-self": "rank 1 passes MPI.COMM_SELF",
    "comm-dup": "rank 1 passes a Dup() of COMM_WORLD",
    "comm-null": "rank 1 passes MPI.COMM_NULL",
    "comm-inter": "rank 1 passes an intercommunicator",
    "comm-str": "rank 1 passes a string",
    "root": "rank 1 passes root=1 to distributed_attention, the others root=0",
}


def _job(case):
    """The child: every rank calls the library; rank 1 misbehaves as ``case`` says."""
    import numpy as np
    from mpi4py import MPI

    import mpiring
    from mpiring.core import block

    world = MPI.COMM_WORLD
    rank, P = world.Get_rank(), world.Get_size()
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((1, 2, 64 * P, 16)) for _ in range(3))
    comm = world
    if rank == 1:
        if case in ("raise", "exit"):
            real, calls = block.attend, [0]

            def attend(*args, **kwargs):
                calls[0] += 1
                if calls[0] == 2:
                    if case == "raise":
                        raise RuntimeError("injected on rank 1")
                    sys.exit(3)
                return real(*args, **kwargs)

            block.attend = attend
        comm = {"comm-self": MPI.COMM_SELF, "comm-null": MPI.COMM_NULL, "comm-str": "world"}.get(case, world)
    if case == "comm-dup":  # every rank makes it (Dup is collective); rank 1 passes it
        dup = world.Dup()
        comm = dup if rank == 1 else world
    if case == "comm-inter":  # every rank builds it (collective); rank 1 then passes it
        local = world.Split(0 if rank < 2 else 1, rank)
        inter = local.Create_intercomm(0, world, 2 if rank < 2 else 0, tag=7)
        comm = inter if rank == 1 else world
    start = time.perf_counter()
    try:
        if case == "root":
            mpiring.distributed_attention(Q, K, V, world, causal=True, root=1 if rank == 1 else 0)
        else:
            q, k, v = (np.ascontiguousarray(mpiring.shard(x, P, rank)) for x in (Q, K, V))
            mpiring.ring_attention(q, k, v, comm, causal=True)
        outcome = "returned"
    except Exception as exc:  # noqa: BLE001 -- the point is to see what each rank gets
        outcome = f"{type(exc).__name__}: {str(exc)[:90]}"
    print(f"rank {rank} after {time.perf_counter() - start:.1f} s: {outcome}", file=sys.stderr, flush=True)
    sys.exit(0 if outcome == "returned" else 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=list(CASES), action="append")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _job(args.child)
    print("| what rank 1 does | job ended after | exit code | what the ranks said |")
    print("|---|---|---|---|")
    for case in args.case or list(CASES):
        start = time.perf_counter()
        job = subprocess.run(mpiexec_argv(3, sys.executable, __file__, "--child", case), capture_output=True,
                             text=True, env=clean_env(), timeout=600)
        took = time.perf_counter() - start
        said = "; ".join(sorted(line for line in job.stderr.splitlines() if line.startswith("rank ")))
        print(f"| {CASES[case]} | {took:.1f} s | {job.returncode} | {said or job.stderr.strip()[-200:]} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
