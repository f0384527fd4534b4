"""A ring attention job in which one rank is made to fail: the fault-injection tests run it.

    mpiexec -n 3 python tests/fault_job.py --fault raise --rank 1 --step 1 --timeout 2 --report DIR
    mpiexec -n 3 python tests/fault_job.py --cli --fault sleep --rank 1 --step 1 -- --seq-len 96 --timeout 2

Faults (on rank ``--rank`` only): ``raise`` an exception (``interrupt``: a
KeyboardInterrupt, which ``except Exception`` does not catch), ``exit`` the process
with ``os._exit(3)``, or ``sleep`` forever. ``--where step`` (default) injects
it when that rank starts computing block number ``--step`` of the ring (with
mode ring one block per step, so the block number is the step); ``--where
setup`` injects it before the rank calls ``ring_attention``. The ring itself
wraps the public hook ``mpiring.core.block.attend`` in its own process.

Library mode (default) runs ``ring_attention`` on seeded shards with
``--timeout`` and writes each rank's outcome (``ok`` or ``ExceptionType:
message``) to ``DIR/rank<r>``, also to stderr; once every rank that is still
alive has reported, the job ends with exit code 1 if any failed. ``--cli``
runs ``python -m mpiring run`` with the arguments after ``--`` instead, so
what ends the job is the tool's own error handling (``comm.Abort``).
"""

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpiring.core.block
from mpiring import ring_attention, shard


def _inject(fault, rank):
    print(f"rank {rank}: injecting fault '{fault}'", file=sys.stderr, flush=True)
    if fault == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if fault == "interrupt":  # a BaseException: not caught by except Exception
        raise KeyboardInterrupt(f"injected interrupt on rank {rank}")
    if fault == "exit":
        os._exit(3)
    if fault == "sleep":
        while True:
            time.sleep(60)


def _patch(fault, at):
    """Make this rank fail when it starts computing block ``at`` of the ring."""
    real, calls = mpiring.core.block.attend, [0]

    def compute(*args, **kwargs):
        if calls[0] == at:
            _inject(fault, MPI.COMM_WORLD.Get_rank())
        calls[0] += 1
        return real(*args, **kwargs)

    mpiring.core.block.attend = compute


def _library(args, comm):
    """Every rank calls ring_attention with a timeout and reports what it got."""
    P, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(0)
    S = 16 * P
    Q, K, V = (rng.standard_normal((2, S, 8)) for _ in range(3))
    q, k, v = (np.ascontiguousarray(shard(x, P, rank, args.layout)) for x in (Q, K, V))
    try:
        if args.where == "setup" and rank == args.rank:
            _inject(args.fault, rank)
        ring_attention(q, k, v, comm, causal=args.causal, layout=args.layout, mode=args.mode,
                       timeout=args.timeout)
        outcome = "ok"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(f"rank {rank}: outcome {outcome}", file=sys.stderr, flush=True)
    with open(os.path.join(args.report, f"rank{rank}.tmp"), "w") as f:
        f.write(outcome)
    os.replace(os.path.join(args.report, f"rank{rank}.tmp"), os.path.join(args.report, f"rank{rank}"))
    # wait for the other live ranks' reports: exiting first would make mpiexec kill them
    alive = [r for r in range(P) if r != args.rank or args.fault == "raise"]
    deadline = time.perf_counter() + 60
    while time.perf_counter() < deadline:
        if all(os.path.exists(os.path.join(args.report, f"rank{r}")) for r in alive):
            break
        time.sleep(0.02)
    sys.stderr.flush()
    if args.fault == "none":
        return  # a normal exit: MPI_Finalize on every rank
    os._exit(0 if outcome == "ok" else 1)  # not MPI_Finalize: a sleeping rank would never join it


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault", choices=["raise", "interrupt", "exit", "sleep", "none"], default="raise")
    parser.add_argument("--rank", type=int, default=1, help="the rank that fails")
    parser.add_argument("--step", type=int, default=1, help="block number at which it fails")
    parser.add_argument("--where", choices=["step", "setup"], default="step")
    parser.add_argument("--cli", action="store_true", help="run 'python -m mpiring run' (arguments after --)")
    parser.add_argument("--timeout", type=float, default=2.0)
    parser.add_argument("--mode", default="ring")
    parser.add_argument("--layout", default="contiguous")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--report", help="directory for the per-rank outcome files (library mode)")
    args, rest = parser.parse_known_args()
    rest = [a for a in rest if a != "--"]
    comm = MPI.COMM_WORLD
    if args.fault != "none" and args.where == "step" and comm.Get_rank() == args.rank:
        _patch(args.fault, args.step)
    if args.cli:
        from mpiring.__main__ import main as cli

        sys.exit(cli(["run", *rest]))
    _library(args, comm)


if __name__ == "__main__":
    main()
