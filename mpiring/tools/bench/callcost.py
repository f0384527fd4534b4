"""``bench callcost``: the fixed cost of a tiny ``Ring`` call as P grows, beside a bare ``Iallreduce``.

    for n in 2 8 32 64; do mpiexec -n $n python -m mpiring bench callcost; done   # one row per P

A call of S = P tokens, H = 1, D = 8, float64: what is left is its fixed cost. The median over samples (each
after a barrier) of the slowest rank's time of ``Ring.forward``, of its agreement alone (``agree.check_call``)
and of a bare ``Iallreduce`` of the agreement's five float64; and the point-to-point requests the agreement
posts per call. Sampling stops after ``--repeats`` samples or ``--budget`` seconds (at least 3).
"""

import time

import numpy as np

import mpiring
from mpiring.core.tuning.threads import cores, launcher_local_ranks
from mpiring.mpi.agree import check_call

from ..cli import at_least, command_parser, table_text
from .probes import cpu_text

__all__ = ["callcost", "callcost_parser", "call_seconds", "agreement_requests", "CountedComm"]


def callcost_parser():
    p = command_parser("bench callcost", callcost)
    p.add_argument("--repeats", type=int, default=200, help="timed calls of each kind, at most")
    p.add_argument("--budget", type=float, default=10.0,
                   help="seconds of sampling after which the repeats stop (at least 3 samples of each kind)")
    p.add_argument("--dim", type=int, default=8, help="head dim")
    p.checks.append(at_least(1, **{"--repeats": "repeats", "--dim": "dim"}))
    p.checks.append(at_least(0, **{"--budget": "budget"}))
    return p


class CountedComm:
    """A communicator that counts the point-to-point requests posted through it."""

    def __init__(self, comm):
        self._comm, self.requests = comm, 0

    def Isend(self, *args, **kwargs):
        self.requests += 1
        return self._comm.Isend(*args, **kwargs)

    def Irecv(self, *args, **kwargs):
        self.requests += 1
        return self._comm.Irecv(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._comm, name)


def agreement_requests(comm, calls=3):
    """Point-to-point requests one rank's per-call agreement posts per call, every rank present (most over ranks)."""
    from mpi4py import MPI

    private = comm.Dup()
    counted = CountedComm(private)
    for _ in range(calls):
        check_call(counted, None, {}, [1.0, 1.0], "auto")
    private.Free()
    return comm.allreduce(counted.requests, op=MPI.MAX) / calls


MIN_SAMPLES = 3  # of each kind, whatever the budget (fewer only if --repeats asks for fewer)


def call_seconds(comm, repeats, dim=8, budget=None):
    """``({kind: median over samples of the slowest rank's seconds}, samples)`` for the tiny call, its agreement
    and a bare Iallreduce, samples of the three kinds interleaved (the machine's drift falls on all three alike);
    ``repeats`` samples of each, or fewer (at least ``MIN_SAMPLES``) once the slowest rank has spent ``budget``
    seconds sampling (None: no limit)."""
    from mpi4py import MPI

    rng = np.random.default_rng(0)
    size, rank = comm.Get_size(), comm.Get_rank()
    q, k, v = (rng.standard_normal((1, size, dim))[:, rank:rank + 1] for _ in range(3))
    mine, every = np.zeros(5), np.empty(5)
    private = comm.Dup()
    kinds = {"Ring.forward": lambda: ring.forward(q, k, v),
             "its agreement": lambda: check_call(private, None, {}, [1.0, 1.0], "auto"),
             "Iallreduce": lambda: comm.Iallreduce(mine, every, op=MPI.MAX).Wait()}
    times = {name: [] for name in kinds}
    with mpiring.Ring(comm, size) as ring:
        for fn in kinds.values():  # warm up
            fn()
        began = time.perf_counter()
        for sample in range(repeats):
            for name, fn in kinds.items():
                comm.Barrier()
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            if (budget is not None and sample + 1 >= MIN_SAMPLES
                    and comm.allreduce(time.perf_counter() - began, op=MPI.MAX) > budget):
                break  # the same decision on every rank: the all-reduced time
    private.Free()
    mine = np.array(list(times.values()))
    slowest = np.empty_like(mine)
    comm.Allreduce(mine, slowest, op=MPI.MAX)
    return {name: float(np.median(t)) for name, t in zip(times, slowest)}, slowest.shape[1]


def callcost(comm, args=None):
    """Time a tiny Ring call (S = P tokens, H = 1, D = 8), its agreement and a bare Iallreduce on P ranks."""
    args = callcost_parser().parse_args(args)
    seconds, samples = call_seconds(comm, args.repeats, args.dim, args.budget)
    requests = agreement_requests(comm)
    if comm.Get_rank() == 0:
        size, here = comm.Get_size(), launcher_local_ranks()
        print(f"CPU: {cpu_text()}; P={size} ({here} ranks on {cores()} cores here"
              f"{', oversubscribed' if here > cores() else ''}); S=P, H=1, D={args.dim}, float64; "
              f"median of {samples} samples of the slowest rank, microseconds")
        print(table_text(["P", *seconds, "its point-to-point requests"],
                         [[size, *(f"{s * 1e6:.0f}" for s in seconds.values()), f"{requests:g}"]], markdown=True))
    return 0
