"""Does a ring step hide its transfer? The K/V transfer alone, then the ring: compute and blocked time per step.

    run/cluster up 2 --link 100mbit
    run/cluster run -n 2 python -m mpiring.tools.overlap --seq-len 8192 --heads 8 --dim 64 --causal

First the transfer of one ring step on its own: every rank sends its K/V
block to the next with the ring's own messages (``RingComm.shift``, the
non-contiguous [k | 1]^T blocks), nothing computed, timed to completion;
the median of ``--repeat``. Then ``ring_attention`` runs ``--repeat`` times,
and rank 0 prints, per step and repeat, the rank blocked longest: its
compute, its blocked time, and the bound ``max(0, transfer - compute)`` that
a perfectly overlapped step would leave it blocked for. Exit code 0 whatever the result: this
measures, it does not judge.
"""

import argparse
import time

import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_limits

from mpiring import Record, ring_attention
from mpiring.mpi.buffers import KVBuffers
from mpiring.mpi.comm import RingComm

__all__ = ["transfer_time", "main"]


def transfer_time(k, v, comm, repeat):
    """Seconds one ring step's K/V transfer takes with nothing computed (median over ``repeat``; all ranks)."""
    with RingComm(comm) as ring:
        buffers = KVBuffers((k, v), k.shape[-2])
        held = buffers.hold((k, v))
        times = []
        for _ in range(repeat):
            incoming = buffers.take(k.shape[-2])
            comm.Barrier()
            start = time.perf_counter()
            ring.shift({+1: held}, {+1: incoming}, pad=1)
            ring.wait()
            times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return float(np.median(times))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpiring.tools.overlap", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--layout", default="contiguous")
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    threadpool_limits(1)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = args.seq_len // size
    rng = np.random.default_rng(rank)
    q, k, v = (rng.standard_normal((1, args.heads, n, args.dim)).astype(np.float32) for _ in range(3))
    transfer = transfer_time(k, v, comm, args.repeat)
    rows = []
    for _ in range(args.repeat):
        rec = Record(rank)
        ring_attention(q, k, v, comm, causal=args.causal, layout=args.layout, record=rec)
        steps = {}
        for name, start, end, info in rec.events:
            if name in ("compute", "wait"):
                steps.setdefault(info["step"], {"compute": 0.0, "wait": 0.0})[name] += end - start
        rows.append(steps)
    everyone = comm.gather(rows, root=0)
    if rank != 0:
        return 0
    print(f"P={size} seq_len={args.seq_len} heads={args.heads} dim={args.dim} float32 causal={args.causal} "
          f"layout={args.layout}; K/V block {2 * k.nbytes / 1e6:.2f} MB per rank and step")
    print(f"transfer alone (one step's K/V, nothing computed): {transfer:.3f} s")
    print("repeat  step  rank  compute s  blocked s  bound max(0, transfer - compute) s   (the rank blocked longest)")
    for rep in range(args.repeat):
        for step in sorted(everyone[0][rep]):
            if step == len(everyone[0][rep]) - 1:
                continue  # the last step sends nothing
            r = max(range(size), key=lambda x: everyone[x][rep][step]["wait"])
            compute, blocked = everyone[r][rep][step]["compute"], everyone[r][rep][step]["wait"]
            print(f"{rep:>6}  {step:>4}  {r:>4}  {compute:>9.3f}  {blocked:>9.3f}  "
                  f"{max(0.0, transfer - compute):>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
