"""Planted wrong (lab 0): the whole array goes round the ring P - 1 times. Right sums, P/2 times the traffic.

    python -m mpiring grade tests/students/labs/allreduce_whole.py --ranks 4     # fails: traffic (from P = 3)
"""

import numpy as np

EXERCISE = "allreduce"


def ring_allreduce(x, comm):
    rank, P = comm.Get_rank(), comm.Get_size()
    total, held = np.array(x, copy=True), np.array(x, copy=True)
    for _ in range(P - 1):
        incoming = np.empty_like(held)
        comm.Sendrecv(held, dest=(rank + 1) % P, recvbuf=incoming, source=(rank - 1) % P)
        total += incoming
        held = incoming
    return total
