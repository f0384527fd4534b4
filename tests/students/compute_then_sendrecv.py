"""Defective for the ring exercise: right answers, but each block is computed before it is passed on (no overlap).

    mpiexec -n 4 python -m mpiring grade tests/students/compute_then_sendrecv.py     # fails: overlap

correct_sendrecv.py's ring, graded as exercise 2, which asks for Isend/Irecv started before the
compute: its blocking Sendrecv_replace after the compute leaves the network idle while it computes.
"""

from correct_sendrecv import ring_attention  # noqa: F401  (graded)

EXERCISE = "ring"
