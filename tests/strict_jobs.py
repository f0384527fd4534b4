"""Jobs for tests/test_strict_mpi.py: what the strict communicator does where a test process could not survive it.

    mpiexec -n 3 python tests/strict_jobs.py bcast      # rank 0 never joins a Bcast: the others raise Stuck
    mpiexec -n 2 python tests/strict_jobs.py deadline   # an untimed Waitall: the job is aborted after 2 s
"""

import sys

import numpy as np
from mpi4py import MPI

from mpiring.testing import Stuck, strict

if sys.argv[1] == "bcast":
    sc = strict(MPI.COMM_WORLD.Dup(), timeout=1)
    try:
        if sc.Get_rank() != 0:
            sc.Bcast(np.zeros(4), root=0)
        print(f"rank {sc.Get_rank()} returned", flush=True)
    except Stuck as exc:
        print(f"Stuck: {exc}", flush=True)
else:
    with strict(MPI.COMM_WORLD.Dup(), timeout=1, deadline=2) as sc:
        request = sc.Irecv(np.empty(4), source=sc.Get_rank(), tag=5)  # nobody sends it
        MPI.Request.Waitall([request])  # this module's MPI is not instrumented: nothing can time this wait
    print("returned", flush=True)
