"""Planted wrong (lab 8): every partial gathered to rank 0 and merged there: P - 1 rounds, not a tree.

    python -m mpiring grade tests/students/labs/decode_gather.py --ranks 4     # fails: tree (from P = 4)
"""

from mpiring import merge
from mpiring.testing import reference

EXERCISE = "decode"


def decode_attention(q, k_cache, v_cache, comm):
    partials = comm.gather(reference(q, k_cache, v_cache), root=0)
    if partials is None:
        return None
    out, lse = partials[0]
    for other in partials[1:]:
        out, lse = merge(out, lse, *other)
    return out, lse
