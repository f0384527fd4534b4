"""Planted wrong (lab 10): the partials that came home are averaged, not weighted by exp(lse_s - lse).

    python -m mpiring grade tests/students/labs/passq_average.py --ranks 4     # fails: merge hint
"""

from _solution import solution

EXERCISE = "passq"
lab = solution("10_passq")
lab.merge = lambda out, lse, other_out, other_lse: (out + other_out, lse)  # summed, then divided by P below


def passq_attention(q, k, v, comm):
    return lab.passq_attention(q, k, v, comm) / comm.Get_size()
