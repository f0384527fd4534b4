"""A job for tests/test_strict_mpi.py: mpi4py's own Waitall (untimed) on a receive nobody sends, under a deadline.

    mpiexec -n 2 python tests/strict_deadline_job.py     # aborted after 2 s, saying what rank 0 waited for
"""

import numpy as np
from mpi4py import MPI

from mpiring.testing import strict

with strict(MPI.COMM_WORLD.Dup(), timeout=1, deadline=2) as sc:
    buf = np.empty(4)
    request = sc.Irecv(buf, source=sc.Get_rank(), tag=5)  # nobody sends it
    MPI.Request.Waitall([request])  # this module's MPI is not instrumented: nothing can time this wait
print("returned", flush=True)
