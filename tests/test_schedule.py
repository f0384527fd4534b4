"""The ring schedule as data: rotation, causal skipping, balance, early stop."""

import pytest

from mpiring import make_plan


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_rotation(size):
    plan = make_plan(4 * size, size)
    assert plan.n_steps == size
    assert plan.schedule.sources() == [[(r - s) % size for r in range(size)] for s in range(size)]
    assert all(t.kind == "full" for row in plan.schedule.table for tasks in row for t in tasks)
    assert plan.messages_per_rank() == 2 * (size - 1)


def test_causal_contiguous_skips_future_blocks():
    plan = make_plan(16, 4, causal=True)
    kinds = [[plan.tasks(s, r)[0].kind for r in range(4)] for s in range(4)]
    assert kinds[0] == ["masked"] * 4  # the diagonal block
    # at step s rank r holds block r - s: the future when r < s
    for s in range(1, 4):
        assert kinds[s] == ["skip" if r < s else "full" for r in range(4)]
    assert plan.visible_pairs() == [10, 26, 42, 58]


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_balanced_layouts_have_equal_causal_work(layout):
    for size in (2, 3, 4):
        plan = make_plan(64 * size, size, causal=True, layout=layout)
        visible = plan.visible_pairs()
        assert max(visible) - min(visible) <= 64 * size  # striped: off by one row per block at most
        if layout == "zigzag":
            assert len(set(plan.computed_pairs())) == 1
    contiguous = make_plan(256, 4, causal=True).visible_pairs()
    assert contiguous[-1] > 6 * contiguous[0]  # the imbalance the layouts fix


@pytest.mark.parametrize("size", [2, 3, 4, 5, 6])
def test_bidirectional_covers_every_block_once_in_fewer_steps(size):
    plan = make_plan(3 * size, size, mode="bidirectional")
    assert plan.n_steps == size // 2 + 1
    for r in range(size):
        seen = [t.source for s in range(plan.n_steps) for t in plan.tasks(s, r)]
        assert sorted(seen) == list(range(size))
    assert sum(plan.rounds.values()) == size - 1


def test_window_stops_the_ring_early():
    plan = make_plan(64, 4, causal=True, window=(10, 0))  # 16 tokens per rank: needs one block back
    assert plan.n_steps == 2 and plan.messages_per_rank() == 2
    plan = make_plan(64, 4, causal=True, window=(17, 0))
    assert plan.n_steps == 3


def test_documents_stop_the_ring_early():
    plan = make_plan(40, 4, cu_seqlens=[0, 10, 20, 30, 40])  # one document per rank
    assert plan.n_steps == 1 and plan.messages_per_rank() == 0


def test_allgather_order():
    plan = make_plan(12, 3, mode="allgather")
    assert plan.schedule.sources() == [[0, 1, 2], [2, 0, 1], [1, 2, 0]]
    assert plan.rounds == {}


@pytest.mark.parametrize("bad,match", [
    (dict(layout="spiral"), "layout"), (dict(mode="tree"), "mode"),
    (dict(window=(1,)), "window"), (dict(window=(-2, 3)), "window"),
    (dict(cu_seqlens=[0, 5]), "end at the total length"), (dict(cu_seqlens=[0, 9, 4, 12]), "non-decreasing"),
])
def test_bad_options(bad, match):
    with pytest.raises(ValueError, match=match):
        make_plan(12, 3, **bad)


def test_too_few_tokens():
    with pytest.raises(ValueError, match="at least one token per rank"):
        make_plan(3, 4)


def test_format_mentions_every_rank():
    text = make_plan(16, 4, causal=True).schedule.format()
    assert "rank 3" in text and "3m" in text and "-" in text
