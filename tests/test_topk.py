"""Top-k blocks chosen by an indexer (``plans.indexer``), the Selected mask and the sparse movement's chosen keys.

    python -m pytest -q tests/test_topk.py

The indexers' scores against a loop over (query, key) pairs from the formulas,
the choice's rules (its own block, causal, ties to the lower block, width), bits
that do not depend on how many queries are scored together, ``Selected.allows``
against a loop over the choice, the plan's travelling keys against the
definition, and the one-process simulator of every strategy against the dense
float64 reference under the choice.
"""

import numpy as np
import pytest

import mpiring
from mpiring import masks
from mpiring.cost.nodes import predicted_bytes
from mpiring.plans.indexer import Selected, block_scores, choose, select
from mpiring.plans.make import make_plan
from mpiring.testing import reference


def _indexer(rng, S, heads=2, dim=4, integer=False):
    draw = (lambda shape: rng.integers(-2, 3, shape).astype(np.float64)) if integer else rng.standard_normal
    return draw((heads, S, dim)), draw((1, S, dim)), draw((heads, S, dim)), rng.random((heads, S))


def test_relu_scores_are_the_lightning_indexers(rng):
    """I(t, s) = sum_j w[j, t] relu(q[j, t] . k[s]); a block scores its best visible key."""
    S, B = 11, 3
    q, k, _, w = _indexer(rng, S)
    got = block_scores(q, k, w, np.arange(S), B, "relu", causal=True)
    for t in range(S):
        token = [sum(w[j, t] * max(0.0, float(q[j, t] @ k[0, s])) for j in range(2)) if s <= t else -np.inf
                 for s in range(S)]
        want = [max(token[b * B:(b + 1) * B]) for b in range(-(-S // B))]
        np.testing.assert_allclose(got[t], want, rtol=1e-13)


def test_mean_scores_are_block_means(rng):
    """score(t, b) = sum_h q[h, t] . mean of block b's keys of head h (the last block: its own tokens)."""
    S, B = 10, 4
    q, _, k, _ = _indexer(rng, S)
    got = block_scores(q, k, None, np.arange(S), B, "mean", causal=True)
    for t in range(S):
        want = [sum(float(q[h, t] @ k[h, b * B:(b + 1) * B].mean(axis=0)) for h in range(2)) for b in range(3)]
        np.testing.assert_allclose(got[t], want, rtol=1e-13)


def test_the_choice_keeps_the_own_block_the_best_and_the_lower_on_ties():
    scores = np.array([[5.0, 1.0, 1.0, 9.0, 1.0],    # query at 9 (own block 2 of 4 tokens): 3 and 4 in the future
                       [0.0, 0.0, 0.0, 0.0, 0.0]])   # query at 17 (own block 4): all tie
    got = choose(scores, np.array([9, 17]), 4, 3, causal=True)
    np.testing.assert_array_equal(got, [[0, 1, 2], [0, 1, 4]])
    np.testing.assert_array_equal(choose(scores, np.array([9, 17]), 4, 3, causal=False), [[0, 2, 3], [0, 1, 4]])
    np.testing.assert_array_equal(choose(scores[:1], np.array([1]), 4, 3, causal=True), [[0, -1, -1]])  # one block


def test_the_choice_does_not_depend_on_how_many_queries_are_scored_together(rng, monkeypatch):
    """The bits of every row, scored alone, in chunks of 3, or all at once (what any P and layout do)."""
    S = 40
    q, k, qm, w = _indexer(rng, S, dim=16)
    for indexer, keys, weights in (("relu", k, w), ("mean", qm, None)):
        whole = select(q, keys, np.arange(S), topk=3, block=4, weights=weights, indexer=indexer)
        scores = block_scores(q, keys, weights, np.arange(S), 4, indexer, True)
        for t in rng.permutation(S)[:8]:
            one = block_scores(q[:, t:t + 1], keys, None if weights is None else weights[:, t:t + 1], np.array([t]),
                               4, indexer, True)
            assert one.tobytes() == scores[t:t + 1].tobytes(), (indexer, t)
        monkeypatch.setattr("mpiring.plans.indexer._CHUNK", 3 * S * 16)  # three rows at a time
        np.testing.assert_array_equal(select(q, keys, np.arange(S), topk=3, block=4, weights=weights,
                                             indexer=indexer), whole)
        monkeypatch.undo()


def test_selected_allows_what_the_choice_says(rng, monkeypatch):
    S, B = 23, 4
    chosen = np.full((S, 3), -1)
    for t in range(S):  # its own block and one before it, at most
        picked = sorted({t // B, int(rng.integers(0, t // B + 1))})
        chosen[t, :len(picked)] = picked
    want = np.array([[(s // B in chosen[t]) and s <= t for s in range(S)] for t in range(S)])
    piece = masks.selected(chosen, B)
    pos = np.arange(S)
    np.testing.assert_array_equal(piece.allows(pos[:, None], pos[None, :]), want)
    monkeypatch.setattr("mpiring.plans.indexer._TABLE", 0)  # the sorted codes instead of the table
    np.testing.assert_array_equal(Selected(chosen, B).allows(pos[:, None], pos[None, :]), want)
    assert not piece.allows(np.array([S, -1]), np.array([0, 0])).any()  # positions beyond the choice: unseen


def test_selected_compares_by_its_choice_and_refuses_another_length():
    chosen = np.array([[0, -1], [0, -1], [0, 1], [1, -1]])
    assert masks.selected(chosen, 2) == masks.selected(chosen.copy(), 2)
    assert masks.selected(chosen, 2) != masks.selected(chosen, 2, causal=False)
    with pytest.raises(ValueError, match="chose blocks for 4 query positions, but the sequence has 6"):
        make_plan(6, 2, mask=masks.selected(chosen, 2))
    for bad, match in ((np.array([0, 1]), "integer array"), (np.array([[0], [5]]), "past the last block")):
        with pytest.raises(ValueError, match=match):
            masks.selected(bad, 2)


def _dense_choice(sel):
    pos = np.arange(sel.seq_len)
    return sel.allows(pos[:, None], pos[None, :])


@pytest.mark.parametrize("layout", mpiring.LAYOUTS)
def test_the_sparse_plan_sends_only_the_chosen_keys(rng, layout):
    """Per (rank, source): the keys of source's block some query of rank may see, and the bytes they cost."""
    S, P = 50, 4
    q, k, _, w = _indexer(rng, S)
    sel = Selected(select(q, k, np.arange(S), topk=2, block=5, weights=w), 5)
    seen = _dense_choice(sel)
    plan = make_plan(S, P, layout=layout, mode="sparse", mask=sel)
    ring = make_plan(S, P, layout=layout, mode="ring", mask=sel)
    shape = dict(batch=1, hq=2, hk=1, dim=8, dim_v=8, itemsize=4)
    for r in range(P):
        tokens = 0
        for j in range(P):
            rows = plan.shards[r], plan.kv_shards[j]
            want = np.flatnonzero(seen[np.ix_(*rows)].any(axis=0))
            if j != r:
                got = plan.kept(r, j) if j in plan.needs[r] else np.array([], int)
                np.testing.assert_array_equal(got, want, err_msg=f"{layout} {r} <- {j}")
                tokens += len(want)
        assert plan.moved_tokens()[r] == tokens
        sent = sum(plan.tokens(u, r) for u in plan.users[r])
        assert predicted_bytes(plan, **shape)[r] == sent * 64
        assert predicted_bytes(plan, **shape, backward=True)[r] == sent * 64 + tokens * 64
    assert sum(predicted_bytes(plan, **shape)) < sum(predicted_bytes(ring, **shape))


@pytest.mark.parametrize("mode", ["ring", "bidirectional", "allgather", "sparse", "ulysses", "double_ring"])
def test_every_strategy_simulated_matches_the_reference(rng, mode):
    S, P = 29, 3
    q, k, _, w = _indexer(rng, S)
    sel = Selected(select(q, k, np.arange(S), topk=3, block=3, weights=w), 3)
    Q, K, V = (rng.standard_normal((6, S, 8)) for _ in range(3))
    out, lse, _ = mpiring.simulate(Q, K, V, P, mask=sel, mode=mode, layout="zigzag")
    want, want_lse = reference(Q, K, V, mask=sel)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)
