"""Defective: right non-causal answers, but the causal case never returns (a loop that never ends).

    python -m mpiring grade tests/students/endless_loop.py --ranks 2 --time-limit 5     # fails: aborted

Only --time-limit ends it: the job is aborted, the summary so far is printed and written, and
the batch grader goes on with the files after it in a new job.
"""

import time

from correct_sendrecv import ring_attention as correct_ring


def ring_attention(q, k, v, comm, causal=False):
    while causal:
        time.sleep(0.05)
    return correct_ring(q, k, v, comm, causal)
