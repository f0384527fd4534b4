"""Errors name rank sets compactly at any number of ranks (``core.ranks.ranks_text``): "ranks 0-63", not 64 numbers."""

import numpy as np
import pytest

from mpiring.core.ranks import ranks_text
from mpiring.plans.checks import verdict
from mpiring.plans.layouts import positions_problem


@pytest.mark.parametrize("ranks, text", [
    ([3], "rank 3"),
    ([0, 1], "ranks 0, 1"),
    (range(64), "ranks 0-63"),
    ([9, 8, 7, 5, 3, 2, 1, 0], "ranks 0-3, 5, 7-9"),
    ([4, 4, 6], "ranks 4, 6"),
    (range(0, 4096, 2), "ranks " + ", ".join(map(str, range(0, 4096, 2)))),
])
def test_ranks_text(ranks, text):
    assert ranks_text(ranks) == text


def test_the_noun_is_the_callers():
    assert ranks_text([5], "root rank") == "root rank 5"
    assert ranks_text(range(1, 4), "node") == "nodes 1-3"


def test_an_agreement_error_at_1024_ranks_is_one_short_line():
    problems = ["layout must be one of contiguous, zigzag, striped; got 'diagonal'"] * 1024
    problems[500] = None
    assert verdict(problems) == (f"ranks 0-499, 501-1023: {problems[0]}")
    assert verdict(["a", "b", "a"]) == "ranks 0, 2: a; rank 1: b"


def test_a_position_held_twice_names_its_holders_once_each():
    parts = [np.array([0, 1]), np.array([1, 2]), np.array([1, 3])]
    assert "(by ranks 0-2)" in positions_problem(parts, 4)
