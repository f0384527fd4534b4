"""Defective: right answers on zigzag shards, but every block is computed in full (balanced, yet no saving).

    mpiexec -n 4 python -m mpiring grade --exercise zigzag tests/students/zigzag_no_skip.py    # fails: work
"""

from no_skip import masked_ring

EXERCISE = "zigzag"  # graded as this exercise unless --exercise says otherwise


def ring_attention(q, k, v, comm, causal=False):
    return masked_ring(q, k, v, comm, causal, "zigzag")
