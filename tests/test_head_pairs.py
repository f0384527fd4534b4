"""``plan.head_pairs``: the visible (query, key) pairs of every (rank, batch entry, head) where a mask is headed,
against a dense mask built from the definition, and the schedule report that shows them. No MPI.

    python -m pytest -q tests/test_head_pairs.py
"""

import numpy as np
import pytest
from flex_cases import B, H, numpy_fn, rules

import mpiring.core.scores as scores
from mpiring import make_plan, masks, shard_indices
from mpiring.cost.plantext import compute_table, head_table


def _dense(fn, causal, sq, sk):
    """``allowed[b, h, q, k]``: the definition at every (batch entry, head, query, key), one at a time."""
    q, k = np.arange(sq)[:, None], np.arange(sk)[None, :]
    allowed = np.stack([np.stack([np.broadcast_to(fn(b, h, q, k), (sq, sk)) for h in range(H)]) for b in range(B)])
    return allowed & (k <= q) if causal else allowed


def _brute(allowed, shards):
    """``(per head, union)`` of each rank's query rows ``shards`` (taken from ``shard_indices``, not the plan)."""
    per_head = np.stack([allowed[:, :, s].sum(axis=(-1, -2)) for s in shards])
    union = [int(allowed.any(axis=(0, 1))[s].sum()) for s in shards]
    return per_head, union


CASES = [(17, 17), (37, 37), (41, 23), (19, 44)]  # (queries, keys): uneven, and cross-attention both ways


@pytest.mark.parametrize("mode", ["ring", "sparse"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("sq, sk", CASES)
@pytest.mark.parametrize("name", list(rules(1, 1)))
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_head_pairs_are_the_definitions(size, name, sq, sk, layout, mode):
    rule, options = rules(sq, sk)[name]
    fn, causal = numpy_fn(rule), options.get("causal", False)
    cross = dict(q_len=sq, kv_layout="contiguous" if layout == "zigzag" else "zigzag") if sq != sk else {}
    plan = make_plan(sk, size, layout=layout, mode=mode, causal=causal,
                     mask=masks.function(fn, batch=B, heads=H), **cross)
    per_head, union = _brute(_dense(fn, causal, sq, sk), [shard_indices(sq, size, r, layout) for r in range(size)])
    assert plan.head_pairs.dtype == np.int64 and plan.head_pairs.shape == (size, B, H)
    np.testing.assert_array_equal(plan.head_pairs, per_head)
    assert plan.visible_pairs() == union  # the union is the work the kernel is given
    assert np.all(plan.head_pairs <= np.array(union)[:, None, None])


def test_an_off_by_one_in_the_rule_is_seen():
    """The brute force tells a rule from the same rule one key off: the comparison above can fail."""
    sq = sk = 37
    rule, _ = rules(sq, sk)["per batch and head"]
    fn = numpy_fn(rule)
    plan = make_plan(sk, 3, layout="zigzag", mask=masks.function(fn, batch=B, heads=H))
    shards = [shard_indices(sq, 3, r, "zigzag") for r in range(3)]
    per_head, _ = _brute(_dense(lambda b, h, q, k: fn(b, h, q, k + 1), False, sq, sk), shards)
    assert np.any(plan.head_pairs != per_head)


@pytest.mark.parametrize("extra", ["padding", "prefix"])
def test_combined_pieces_and_small_chunks(monkeypatch, extra):
    """A headed piece with padding (batched) or a prefix (rows that see no key), and a window, counted a few rows
    at a time and in one chunk."""
    sq = sk = 29
    rule, _ = rules(sq, sk)["per-head tiles, causal"]
    fn = numpy_fn(rule)
    q, k = np.arange(sq)[:, None], np.arange(sk)[None, :]
    lengths = np.array([21, 29])
    piece, allowed = {"padding": (masks.padding(lengths), k < lengths[:, None, None, None]),
                      "prefix": (masks.prefix(11), (q < 11) & (k < 11))}[extra]
    mask = masks.function(fn, batch=B, heads=H) & piece
    whole = make_plan(sk, 3, layout="zigzag", window=(6, 2), mask=mask).head_pairs
    monkeypatch.setattr(scores, "_CHUNK", 3 * B * H)
    chunked = make_plan(sk, 3, layout="zigzag", window=(6, 2), mask=mask).head_pairs
    allowed = _dense(fn, False, sq, sk) & allowed & (k >= q - 6) & (k <= q + 2)
    per_head, _ = _brute(allowed, [shard_indices(sq, 3, r, "zigzag") for r in range(3)])
    np.testing.assert_array_equal(whole, per_head)
    np.testing.assert_array_equal(chunked, per_head)


@pytest.mark.parametrize("mask", [(), masks.function(lambda q, k: k % 3 != 1), masks.padding(np.array([20, 30]))])
def test_no_headed_piece_no_head_pairs(mask):
    assert make_plan(30, 3, layout="zigzag", causal=True, mask=mask).head_pairs is None


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_the_schedule_report_shows_each_heads_share(mode):
    """Per rank's query tokens, as the ring modes work on them (Ulysses' ranks each do the whole sequence)."""
    sq = sk = 37
    rule, options = rules(sq, sk)["per-head tiles, causal"]
    fn = numpy_fn(rule)
    plan = make_plan(sk, 3, layout="zigzag", mode=mode, mask=masks.function(fn, batch=B, heads=H), **options)
    per_head, union = _brute(_dense(fn, True, sq, sk), [shard_indices(sq, 3, r, "zigzag") for r in range(3)])
    text = compute_table(plan)
    assert head_table(plan.head_pairs, union) in text
    rows = {line.split()[0]: line.split() for line in text.splitlines()[-6:]}
    for r in range(3):
        assert rows[str(r)][1:] == [str(union[r]), str(per_head[r].min()), f"{per_head[r].mean():.1f}",
                                    str(per_head[r].max()), f"{per_head[r].mean() / union[r]:.3f}"]
    used = text.splitlines()[-1].split(": ", 1)[1].split()
    assert used == [f"{h}:{per_head[:, :, h].sum() / (B * sum(union)):.3f}" for h in range(H)]
    assert "per (batch entry" not in compute_table(make_plan(sk, 3, layout="zigzag", causal=True))
