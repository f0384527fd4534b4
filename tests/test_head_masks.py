"""Masks per batch entry and head (``masks.function(fn(batch, head, q_pos, k_pos), batch=, heads=)``), and
cross-attention, without MPI: the reference against flex_attention and autograd, the plan's and the sparse
movement's union over heads against the definition, the simulator, and the refusals.

    python -m pytest -q tests/test_head_masks.py
"""

import numpy as np
import pytest
from flex_cases import B, H, arrays, expected, numpy_fn, rules

from mpiring import Spec, make_plan, masks, shard_indices
from mpiring.cost.nodes import predicted_bytes
from mpiring.testing import reference, reference_backward


def _mask(rule):
    return masks.function(numpy_fn(rule), batch=B, heads=H)


@pytest.mark.parametrize("sq, sk", [(17, 17), (9, 22), (22, 9)])
@pytest.mark.parametrize("name", list(rules(1, 1)))
def test_the_reference_is_flex_attention_and_autograd(name, sq, sk):
    pytest.importorskip("torch")
    rule, options = rules(sq, sk)[name]
    Q, K, V, dO = arrays(sq, sk)
    want = expected(rule, options.get("causal", False), Q, K, V, dO)
    out, lse = reference(Q, K, V, mask=_mask(rule), **options)
    grads = reference_backward(dO, Q, K, V, mask=_mask(rule), **options)
    for got, ref in zip((out, lse, *grads), want):
        np.testing.assert_allclose(got, ref, atol=1e-12, rtol=0)


def _union(rule, options, sq, sk):
    """Which (query, key) pairs some batch entry and head sees: the definition, every (b, h) evaluated."""
    fn = numpy_fn(rule)
    ok = np.zeros((sq, sk), bool)
    for b in range(B):
        for h in range(H):
            ok |= np.broadcast_to(fn(b, h, np.arange(sq)[:, None], np.arange(sk)[None, :]), (sq, sk))
    return ok & (np.arange(sk)[None, :] <= np.arange(sq)[:, None]) if options.get("causal") else ok


@pytest.mark.parametrize("P", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(rules(1, 1)))
def test_the_sparse_movement_sends_the_union_over_heads_and_its_model(name, P):
    """A rank receives a block iff some batch entry and head of its queries sees a key of it; the bytes the cost
    model predicts each rank sends are those blocks' (the whole block: every head of K/V travels)."""
    shape = dict(batch=B, hq=H, hk=2, dim=8, dim_v=8, itemsize=8)
    per_token = B * 2 * 16 * 8
    for sq, sk, layout in ((6 * P + 1, 6 * P + 1, "zigzag"), (6 * P + 1, 3 * P + 2, "contiguous")):
        rule, options = rules(sq, sk)[name]
        cross = dict(kv_seq_len=sk) if sq != sk else {}
        plan = Spec.of(seq_len=sq, mode="sparse", layout=layout, mask=_mask(rule), **options, **cross).plan(P)
        seen = _union(rule, options, sq, sk)
        qs = [shard_indices(sq, P, r, layout) for r in range(P)]
        ks = [shard_indices(sk, P, r, layout) for r in range(P)]
        needs = [{j for j in range(P) if j != r and seen[np.ix_(qs[r], ks[j])].any()} for r in range(P)]
        assert [set(plan.needs[r]) for r in range(P)] == needs, (name, P, layout)
        got = predicted_bytes(plan, **shape)
        sent = [len(ks[j]) * per_token * sum(j in needs[r] for r in range(P)) for j in range(P)]
        assert got == sent, (name, P, layout)  # each rank sends its block once to each rank that needs it
        pairs = [int(sum(seen[np.ix_(qs[r], ks[j])].sum() for j in range(P))) for r in range(P)]
        assert [sum(plan.pairs[r]) for r in range(P)] == pairs  # the union: the pairs the kernel is given


def test_a_function_says_its_batch_entries_and_heads():
    with pytest.raises(ValueError, match="batch= must give how many"):
        masks.function(lambda b, h, q, k: q >= k)
    with pytest.raises(ValueError, match="heads= must give how many"):
        masks.function(lambda b, h, q, k: q >= k, batch=2)
    with pytest.raises(ValueError, match="is for fn\\(batch, head, q_pos, k_pos\\)"):
        masks.function(lambda q, k: q >= k, heads=2)
    with pytest.raises(ValueError, match="takes 3 arguments"):
        masks.function(lambda h, q, k: q >= k)
    m = masks.function(lambda b, h, q, k: (q >= k) & (h == 1), batch=1, heads=2)
    assert m.allows(np.arange(3)[:, None], np.arange(3)[None, :]).shape == (1, 2, 3, 3)
    assert m != masks.function(lambda b, h, q, k: (q >= k) & (h == 1), batch=1, heads=3)
    spec = Spec.of(mask=m)
    assert "q holds 2 batch entries" in spec.scores_problem(np.zeros((2, 2, 4, 8)))
    assert "and 3 heads" in spec.scores_problem(np.zeros((1, 3, 4, 8)))
    assert spec.scores_problem(np.zeros((1, 2, 4, 8))) is None
    other = masks.function(lambda b, h, q, k: q >= k, batch=1, heads=4)
    with pytest.raises(ValueError, match="over different \\(batch, heads\\)"):
        (m & other).allows(np.arange(2)[:, None], np.arange(2)[None, :])


def test_the_content_agreement_reads_the_tables_a_function_uses():
    """Two ranks whose per-head tables differ have different masks: the table is part of the function's content."""
    table = np.zeros((2, 4), bool)
    make = lambda t: masks.function(lambda b, h, q, k: t[h, k] | (k <= q), batch=1, heads=2)  # noqa: E731
    first, same, other = make(table), make(table.copy()), make(~table)
    assert first == same and first != other
    assert Spec.of(mask=first).digest == Spec.of(mask=same).digest != Spec.of(mask=other).digest


def test_cross_attention_takes_its_own_layouts_and_refuses_by_name():
    plan = Spec.of(seq_len=10, kv_seq_len=7, layout="zigzag", kv_layout="striped", causal=True).plan(2)
    assert [list(plan.shards[r]) for r in range(2)] == [list(shard_indices(10, 2, r, "zigzag")) for r in range(2)]
    assert [list(plan.kv_shards[r]) for r in range(2)] == [list(shard_indices(7, 2, r, "striped")) for r in range(2)]
    seen = np.arange(7)[None, :] <= np.arange(10)[:, None]  # causal as flex states it: k_pos <= q_pos
    assert plan.sequence_pairs() == int(seen.sum())
    with pytest.raises(ValueError, match="kv_layout is cross-attention's"):
        Spec.of(kv_layout="zigzag")
    with pytest.raises(ValueError, match="not positions= or cu_seqlens="):
        Spec.of(kv_seq_len=8, cu_seqlens=[0, 4, 8])
    with pytest.raises(ValueError, match="need at least one query per rank"):
        make_plan(8, 4, q_len=3)
    with pytest.raises(ValueError, match="need at least one token per rank: kv_seq_len=3, ranks=4"):
        Spec.of(kv_seq_len=3).plan(4, 8)
    with pytest.raises(ValueError, match="kv_seq_len must be a positive integer"):
        Spec.of(kv_seq_len=0)
    assert not Spec.of(kv_seq_len=8).same_rows and Spec.of().same_rows
    lse_tag = Spec.of(kv_seq_len=8).made_by(2, 1.0)
    assert lse_tag["kv_seq_len"] == 8 and lse_tag["digest"] != Spec.of(kv_seq_len=9).made_by(2, 1.0)["digest"]


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_the_simulator_runs_cross_attention_with_a_mask_per_head(P):
    """One process plays P devices: queries (zigzag) over another sequence's keys (contiguous), as the reference."""
    from mpiring.simulate import simulate, simulate_backward

    sq, sk = 4 * P + 1, 3 * P + 2
    rule, options = rules(sq, sk)["per batch and head"]
    Q, K, V, dO = arrays(sq, sk, seed=P)
    kw = dict(options, mask=_mask(rule), kv_seq_len=sk, layout="zigzag", kv_layout="contiguous")
    out, lse, _ = simulate(Q, K, V, P, **kw)
    grads = simulate_backward(dO, Q, K, V, out, lse, P, **kw)
    want = (*reference(Q, K, V, mask=_mask(rule), **options), *reference_backward(dO, Q, K, V, mask=_mask(rule),
                                                                                  **options))
    for got, ref in zip((out, lse, *grads), want):
        np.testing.assert_allclose(got, ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=f"mismatched shapes.*kv_seq_len={sk}"):
        simulate(Q, K[..., :-1, :], V[..., :-1, :], P, **kw)
