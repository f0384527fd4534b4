"""The sparse movement's plan, bytes and text, without MPI: the graph of needed blocks against the masks' definition.

    python -m pytest -q tests/test_sparse.py
"""

import itertools

import numpy as np
import pytest

from mpiring import LAYOUTS, Spec, make_plan, shard_indices
from mpiring.core.reference import definition_mask
from mpiring.cost.nodes import predicted_bytes
from mpiring.cost.plantext import moves_text
from mpiring.plans.visibility import Window
from mpiring.tools.cli_plan import schedule

MASKS = [{}, dict(causal=True), dict(causal=True, window=(3, 0)), dict(window=(2, 5)),
         dict(causal=True, cu_seqlens="docs"), dict(causal=True, causal_block=4),
         dict(window=(4, 1), cu_seqlens="docs"), dict(causal=True, mask=(Window(6, 0),))]
SHAPE = dict(batch=2, hq=4, hk=2, dim=8, dim_v=4, itemsize=4)


def _options(mask, S):
    if mask.get("cu_seqlens") == "docs":
        return dict(mask, cu_seqlens=[0, 1, S // 3, S // 3, S - 2, S])
    return mask


def _cases():
    for P, layout, mask in itertools.product((1, 2, 3, 5), LAYOUTS, MASKS):
        for S in sorted({P, 2 * P + 1, 7 * P + 3}):
            if mask.get("cu_seqlens") and S < 6:
                continue
            yield P, S, layout, _options(mask, S)


def test_a_rank_needs_the_blocks_its_queries_see():
    """From the definition (``definition_mask`` on ``shard_indices``), not from the plan under test."""
    for P, S, layout, mask in _cases():
        plan = make_plan(S, P, layout=layout, mode="sparse", **mask)
        pos = np.arange(S)
        seen = definition_mask(pos, pos, **mask)
        shards = [shard_indices(S, P, r, layout) for r in range(P)]
        needs = [{j for j in range(P) if j != r and seen[np.ix_(shards[r], shards[j])].any()} for r in range(P)]
        note = (P, S, layout, mask)
        assert [set(plan.needs[r]) for r in range(P)] == needs, note
        assert [plan.users[j] for j in range(P)] == [[r for r in range(P) if j in needs[r]] for j in range(P)], note
        assert plan.n_steps == 1 + max(map(len, needs)), note
        for r in range(P):  # the nearest ring offset first, one block a step after the own
            assert plan.needs[r] == sorted(needs[r], key=lambda j: (r - j) % P), note
            assert [t.source for s in range(plan.n_steps) for t in plan.tasks(s, r)] == [r] + plan.needs[r], note


def test_bytes_are_the_minimum_and_never_more_than_the_ring():
    per_token = SHAPE["batch"] * SHAPE["hk"] * (SHAPE["dim"] + SHAPE["dim_v"]) * SHAPE["itemsize"]
    for P, S, layout, mask in _cases():
        sparse, ring = (make_plan(S, P, layout=layout, mode=m, **mask) for m in ("sparse", "ring"))
        forward, backward = predicted_bytes(sparse, **SHAPE), predicted_bytes(sparse, **SHAPE, backward=True)
        received = [sum(len(sparse.kv_shards[j]) for j in sparse.needs[r]) * per_token for r in range(P)]
        note = (P, S, layout, mask)
        assert sum(forward) == sum(received), note
        assert backward == [f + n * per_token for f, n in  # float32 partials: as many bytes as K/V
                            zip(forward, [sum(len(sparse.kv_shards[j]) for j in sparse.needs[r]) for r in range(P)])]
        assert sum(forward) <= sum(predicted_bytes(ring, **SHAPE)), note
        assert sum(backward) <= sum(predicted_bytes(ring, **SHAPE, backward=True)), note
        assert [sparse.messages_of(r) for r in range(P)] == [2 * len(sparse.users[r]) for r in range(P)], note


def test_the_spec_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="rotate='q'"):
        Spec.of(mode="sparse", rotate="q")
    with pytest.raises(ValueError, match="ulysses_size combines with mode ring"):
        make_plan(16, 4, mode="sparse", ulysses_size=2)
    assert Spec.of(mode="sparse").strategy == "sparse"


def test_the_schedule_shows_the_movement(capsys):
    plan = make_plan(64, 4, layout="zigzag", mode="sparse", causal=True, window=(16, 0))
    text = moves_text(plan)
    assert "rank   0  0: 0->1, 0: 0->2" in text  # zigzag: rank 0 holds both ends; ranks 1 and 2 see them
    assert text.splitlines()[-1].split() == ["total", "160", "160"]  # tokens sent = tokens needed
    assert schedule(None, ["-P", "4", "--mode", "sparse", "--causal", "--window", "2", "0", "--moves"]) == 0
    out = capsys.readouterr().out
    assert "rank   3  -" in out and "mode=sparse" in out  # the last rank's block: nobody needs it


def test_a_rank_plans_from_its_own_row_and_column():
    """Rank 0's steps and users read its own row and column of pairs, not all P x P (n_steps would)."""
    P = 64
    plan = make_plan(16 * P, P, mode="sparse", layout="zigzag", causal=True, window=(10, 0))
    steps = [plan.tasks(s, 0) for s in range(plan.steps_of(0))]
    users = plan.users[0]
    assert repr(plan.needs) == f"Rows({P}, 1 made)" and repr(plan.users) == f"Rows({P}, 1 made)"
    assert [t.source for (t,) in steps] == [0] + plan.needs[0] and users
    assert plan.n_steps == max(plan.steps_of(r) for r in range(P))  # now every row
