"""Planted wrong (lab 9): K/V heads expanded with np.tile: query head h reads K/V head h % Hkv, not h // G.

    python -m mpiring grade tests/students/labs/gqa_tile.py --ranks 4     # fails: GQA head mapping hint
"""

import numpy as np
from _solution import solution

from mpiring import merge

EXERCISE = "gqa"
lab = solution("09_gqa")


def ring_attention(q, k, v, comm, causal=False):
    rank, P = comm.Get_rank(), comm.Get_size()
    n, G = q.shape[1], q.shape[0] // k.shape[0]
    rows = np.arange(rank * n, (rank + 1) * n)
    out, lse = np.zeros(q.shape), np.full(q.shape[:-1], -np.inf)
    kv = np.ascontiguousarray(np.stack([k, v]))
    for step in range(P):
        source = (rank - step) % P
        if not causal or source <= rank:
            kb, vb = (np.tile(x, (G, 1, 1)) for x in kv)  # the bug: np.repeat(x, G, axis=0) is right
            out, lse = merge(out, lse, *lab.attend(q, kb, vb, rows, np.arange(source * n, (source + 1) * n), causal))
        if step < P - 1:
            comm.Sendrecv_replace(kv, dest=(rank + 1) % P, source=(rank - 1) % P)
    return out.astype(q.dtype)
