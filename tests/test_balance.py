"""Load balancers: every method returns a partition; greedy meets its target; plans from positions."""

from pathlib import Path

import numpy as np
import pytest

from mpiring import balance, make_plan
from mpiring.core.reference import definition_mask
from mpiring.plans.balancers import METHODS, imbalance, markdown_table, work

# causal packed documents of very different lengths (one long, many short), and block-causal video
DOCS = dict(causal=True, cu_seqlens=np.array([0, 9000, 9100, 12000, 12100, 12150, 16000, 16384]))
VIDEO = dict(causal=True, causal_block=512)
WORKLOADS = [("causal", 16384, dict(causal=True)), ("documents", 16384, DOCS), ("video", 16 * 512, VIDEO),
             ("window", 16384, dict(causal=True, window=(1024, 0)))]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seq_len, size", [(1, 1), (7, 3), (64, 4), (1000, 6), (37, 5)])
def test_every_method_returns_a_partition(method, seq_len, size):
    cu = np.array(sorted({0, seq_len // 3, seq_len}))
    parts = balance(seq_len, size, causal=True, cu_seqlens=cu, method=method)
    assert len(parts) == size and all(len(p) > 0 for p in parts)
    assert all(np.all(np.diff(p) > 0) for p in parts)
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(seq_len))


@pytest.mark.parametrize("name, seq_len, mask", WORKLOADS, ids=[w[0] for w in WORKLOADS])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_greedy_is_within_five_percent(name, seq_len, mask, size):
    loads = work(balance(seq_len, size, method="greedy", **mask), seq_len, **mask)
    assert imbalance(loads) <= 1.05, (name, size, loads)


def test_contiguous_is_what_greedy_fixes():
    for seq_len, mask in ((16384, DOCS), (8192, VIDEO)):
        assert imbalance(work(balance(seq_len, 4, method="contiguous", **mask), seq_len, **mask)) > 1.5


def test_headtail_balances_every_document():
    """Per-document head-tail: each document's own causal work is even over the ranks (zigzag is not)."""
    cu = DOCS["cu_seqlens"]
    parts = balance(16384, 4, method="headtail", **DOCS)
    for a, b in zip(cu[:-1], cu[1:]):
        if b - a >= 8 * 64:  # long enough for 2P chunks of many tokens
            inside = [p[(p >= a) & (p < b)] - a for p in parts]
            assert imbalance(work(inside, int(b - a), causal=True)) < 1.02
    assert imbalance(work(parts, 16384, **DOCS)) < imbalance(work(balance(16384, 4, method="zigzag"), 16384, **DOCS))


def test_work_is_the_visible_pairs_of_the_definition():
    """``work`` counts what the reference mask lets through, and the plan from the positions agrees."""
    seq_len, mask = 90, dict(causal=True, causal_block=7, window=(20, 0), cu_seqlens=np.array([0, 33, 90]))
    parts = balance(seq_len, 3, method="greedy", **mask)
    every = np.arange(seq_len)
    want = [int(definition_mask(p, every, **mask).sum()) for p in parts]
    assert work(parts, seq_len, **mask) == want
    shuffled = [np.random.default_rng(r).permutation(p) for r, p in enumerate(parts)]
    assert make_plan(seq_len, 3, positions=shuffled, **mask).visible_pairs() == want


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_a_layout_given_as_positions_plans_the_same(layout):
    for size in (1, 2, 3, 4):
        for seq_len in (5 * size, 64 * size + 3):
            for mask in (dict(causal=True), dict(window=(9, 2)), dict(causal=True, cu_seqlens=[0, seq_len // 2,
                                                                                                seq_len])):
                a = make_plan(seq_len, size, layout=layout, **mask)
                b = make_plan(seq_len, size, positions=balance(seq_len, size, method=layout), **mask)
                assert a.schedule == b.schedule and a.runs == b.runs and a.pairs == b.pairs


def test_bad_arguments():
    with pytest.raises(ValueError, match="method must be one of"):
        balance(10, 2, method="spiral")
    with pytest.raises(ValueError, match="at least one token per rank"):
        balance(3, 4)
    with pytest.raises(ValueError, match="needs causal=True"):
        balance(10, 2, causal_block=2)
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        balance(10, 2, cu_seqlens=[0, 5, 9])


def test_the_tables_in_the_docs_are_what_the_code_computes():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "balance.md").read_text()
    for size, computed in ((4, False), (8, False), (4, True)):
        assert markdown_table(size, computed=computed) in doc, (size, computed)


def test_frame_causal_blocks_from_positions():
    """One frame per rank: a rank sees its whole own frame (a full block, not a triangle) and skips later ones."""
    plan = make_plan(4 * 8, 4, causal=True, causal_block=8)
    assert [[plan.kinds[r][j] for j in range(4)] for r in range(4)] == \
        [["full" if j <= r else "skip" for j in range(4)] for r in range(4)]
    plan = make_plan(4 * 8, 4, causal=True, causal_block=1)  # F = 1 is plain causal
    assert plan.kinds == make_plan(4 * 8, 4, causal=True).kinds


def test_queries_against_a_longer_kv_plan():
    """Prefill: 100 cached tokens over 4 ranks, one new token per rank; every cached block is fully visible."""
    kv = [np.arange(25 * r, 25 * r + 25).tolist() + [100 + r] for r in range(4)]
    q = [np.array([103 - r]) for r in range(4)]
    plan = make_plan(104, 4, causal=True, positions=q, kv_positions=kv)
    assert plan.visible_pairs() == [sum(1 for p in range(104) if p <= 103 - r) for r in range(4)]
    assert plan.kinds[3][0] == "full" and plan.kinds[3][1] == "masked"  # query 100 sees keys 0..24 and 100, not 101
    assert [len(s) for s in plan.kv_shards] == [26] * 4 and plan.kv_orders == [None] * 4


@pytest.mark.parametrize("positions, kv, message", [
    ([[0, 1], [2]], None, "one array per rank"),
    ([[0, 1], [1, 2], [3]], None, "position 1 is held more than once \\(by ranks 0, 1\\)"),
    ([[0, 1], [2, 5], [3]], None, "outside 0 .. 4"),
    ([[0, 1], [2], [3]], None, "no rank holds 4"),
    ([[0, 1], [], [2, 3, 4]], None, "rank 1 is empty"),
    ([[0.0, 1.0], [2, 3], [4]], None, "1-D integer array"),
    ([[0], [1], [2]], [[0, 1], [2, 3], [4, 4]], "kv_positions: position 4 is held more than once \\(by rank 2\\)"),
    (None, [[0, 1], [2, 3], [4]], "kv_positions needs positions"),
])
def test_bad_positions(positions, kv, message):
    with pytest.raises(ValueError, match=message):
        make_plan(5, 3, positions=positions, kv_positions=kv)


def test_the_ring_stops_where_the_positions_need_nothing_more():
    """One packed document per rank, each rank's tokens shuffled: no block travels at all."""
    rng = np.random.default_rng(0)
    cu = [0, 7, 20, 21, 40]
    parts = [rng.permutation(np.arange(a, b)) for a, b in zip(cu[:-1], cu[1:])]
    plan = make_plan(40, 4, cu_seqlens=cu, positions=parts)
    assert plan.n_steps == 1 and plan.messages_per_rank() == 0
    assert plan.orders[1] is not None and np.array_equal(parts[1][plan.orders[1]], np.arange(7, 20))
