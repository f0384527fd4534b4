"""Exercise 1: merge the softmax results of two key blocks (the log-sum-exp rule).

    mpiexec -n 1 python -m mpiring grade --exercise merge examples/exercises/01_merge.py

Fill in the TODOs; docs/exercises.md explains the exercise and what the grader checks.
"""

# ruff: noqa: F401  (a skeleton: incomplete until its TODOs are done)

import numpy as np

EXERCISE = "merge"


def merge(out1, lse1, out2, lse2):
    """Attention over the keys of two blocks, from each block's (out, lse): returns (out, lse).

    out_b (..., n, D) is softmax attention over block b alone, lse_b (..., n) its log-sum-exp
    log sum_j exp(s_j). A row's weight for block b is exp(lse_b - lse), lse the merged one.
    """
    # TODO: lse = log(exp(lse1) + exp(lse2)), computed without overflow (subtract m = max(lse1, lse2) first)
    # TODO: out = exp(lse1 - lse) * out1 + exp(lse2 - lse) * out2 (broadcast the weights over D)
    # TODO: a row that neither block sees (lse1 = lse2 = -inf) must give out 0 and lse -inf, not NaN
    raise NotImplementedError("exercise 1: merge two softmax blocks")
