"""Top-k attention chosen by an indexer under context parallelism, on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_topk_mpi.py

``select_topk`` gives every rank the choice the one-process indexer makes
(``plans.indexer.select`` over the whole sequence), for any layout, ties
included; every strategy runs attention under that choice forward and
backward against the dense float64 reference that uses the same choice
(``modecheck.check_mode``: also bytes against the cost model, messages,
tasks); the sparse movement sends each rank exactly the keys its queries
chose (counted here from the mask's definition), fewer than the dense ring;
the indexer's own bytes are what its docstring says; bad input raises on
every rank.
"""

import numpy as np
import pytest
from modecheck import check_mode
from modecheck import problem as _problem

from mpiring import LAYOUTS, Record, ring_attention, ring_attention_backward, select_topk, shard_indices
from mpiring.plans.indexer import Selected, select
from mpiring.testing import reference

pytestmark = pytest.mark.mpi


def _indexer(S, heads=2, dim=4, seed=0, integer=False):
    """Whole indexer arrays from one seed (the same on every rank): q, DSA's shared k, per-head k, weights."""
    rng = np.random.default_rng([seed, S])
    draw = (lambda shape: rng.integers(-1, 2, shape).astype(np.float32)) if integer else \
        (lambda shape: rng.standard_normal(shape).astype(np.float32))
    return draw((heads, S, dim)), draw((1, S, dim)), draw((heads, S, dim)), rng.random((heads, S)).astype(np.float32)


def _positions(comm, S, seed):
    """An uneven, unsorted partition of the positions (the same on every rank), and this rank's part."""
    rng = np.random.default_rng([seed, comm.size])
    cuts = np.sort(rng.choice(np.arange(1, S), comm.size - 1, replace=False))
    return np.split(rng.permutation(S), cuts)[comm.rank]


@pytest.mark.parametrize("indexer", ["relu", "mean"])
@pytest.mark.parametrize("integer", [False, True])  # small integers: many exact ties
def test_every_rank_gets_the_one_process_choice(comm, indexer, integer):
    for S, topk, block in ((comm.size, 1, 1), (6 * comm.size + 5, 3, 4), (9 * comm.size + 2, 4, 1)):
        q, k1, kh, w = _indexer(S, integer=integer)
        keys, weights = (k1, w) if indexer == "relu" else (kh, None)
        want = Selected(select(q, keys, np.arange(S), topk=topk, block=block, weights=weights, indexer=indexer), block)
        for held in (*LAYOUTS, "positions"):
            rows = _positions(comm, S, S) if held == "positions" else shard_indices(S, comm.size, comm.rank, held)
            where = dict(positions=rows) if held == "positions" else dict(seq_len=S, layout=held)
            rec = Record()
            got = select_topk(q[:, rows], keys[:, rows], comm, topk=topk, block=block, indexer=indexer,
                              weights=None if weights is None else weights[:, rows], record=rec, **where)
            assert got == want, (S, held)
            np.testing.assert_array_equal(got.chosen, want.chosen)
            width = min(topk, -(-S // block))
            assert rec.bytes_sent == (comm.size - 1) * (keys[:, rows].nbytes + len(rows) * width * 4), (S, held)


def test_ties_go_to_the_own_block_then_the_lower_ones(comm):
    """All-zero indexer queries: every score ties, so a query keeps its own block and the first ones."""
    S, B, k = 8 * comm.size + 3, 2, 3
    rows = shard_indices(S, comm.size, comm.rank, "striped")
    q = np.zeros((1, S, 4))
    got = select_topk(q[:, rows], np.ones((1, len(rows), 4)), comm, topk=k, block=B, seq_len=S, layout="striped")
    for t in range(S):
        own = t // B
        first = [b for b in range(own) if b < k - 1]
        assert list(got.chosen[t][got.chosen[t] >= 0]) == sorted(first + [own]), t


STRATEGIES = {"ring": dict(mode="ring"), "bidirectional": dict(mode="bidirectional"),
              "allgather": dict(mode="allgather"), "sparse": dict(mode="sparse"), "ulysses": dict(mode="ulysses"),
              "double_ring": dict(mode="double_ring", node_size=1)}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_strategy_under_the_choice_matches_the_reference(comm, rng, strategy, layout):
    P = comm.size
    for S in sorted({P, 2 * P + 1, 5 * P + 3}):  # one token per rank, uneven shards, longer ones
        q, k, _, w = _indexer(S, seed=1)
        rows = shard_indices(S, P, comm.rank, layout)
        sel = select_topk(q[:, rows], k[:, rows], comm, topk=2, block=2, weights=w[:, rows], seq_len=S,
                          layout=layout)
        arrays = _problem(rng, S, 2 * P, P)  # query heads any strategy splits
        check_mode(comm, *arrays, dict(STRATEGIES[strategy], layout=layout, mask=sel), f"{strategy} S={S}")


def test_pass_q_under_the_choice_matches_the_reference(comm, rng):
    """The queries travel (their bytes are pass-Q's own model, tests/test_passq_mpi.py); out and lse here."""
    S = 5 * comm.size + 2
    q, k, _, w = _indexer(S, seed=4)
    rows = shard_indices(S, comm.size, comm.rank, "zigzag")
    sel = select_topk(q[:, rows], k[:, rows], comm, topk=2, block=2, weights=w[:, rows], seq_len=S, layout="zigzag")
    Q, K, V, _ = _problem(rng, S, 4, 2)
    out, lse = ring_attention(*(np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V)), comm, rotate="q",
                              layout="zigzag", mask=sel)
    want, want_lse = reference(Q[..., rows, :], K, V, mask=sel, q_positions=rows)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)


def test_the_grid_under_the_choice(comm, rng):
    if comm.size % 2:
        pytest.skip("the grid needs an even number of ranks")
    S = 4 * comm.size + 1
    q, k, _, w = _indexer(S, seed=2)
    rows = shard_indices(S, comm.size, comm.rank, "zigzag")
    sel = select_topk(q[:, rows], k[:, rows], comm, topk=2, block=3, weights=w[:, rows], seq_len=S, layout="zigzag")
    check_mode(comm, *_problem(rng, S, 4, 2), dict(mode="ring", ulysses_size=2, layout="zigzag", mask=sel), "grid")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_sparse_movement_sends_exactly_the_chosen_keys(comm, rng, layout):
    """Received K/V tokens, from the definition of the choice (a dense table here), and never more than the ring."""
    P, S, B = comm.size, 12 * comm.size + 5, 3
    q, k, _, w = _indexer(S, seed=3)
    rows = shard_indices(S, P, comm.rank, layout)
    sel = select_topk(q[:, rows], k[:, rows], comm, topk=2, block=B, weights=w[:, rows], seq_len=S, layout=layout)
    pos = np.arange(S)
    seen = np.array([[(s // B in sel.chosen[t]) and s <= t for s in pos] for t in pos])
    shards = [shard_indices(S, P, r, layout) for r in range(P)]
    wanted = [[int(seen[np.ix_(shards[r], shards[j])].any(axis=0).sum()) if j != r else 0 for j in range(P)]
              for r in range(P)]
    Q, K, V, dO = _problem(rng, S, 2, 1, np.float32, dim=8, dim_v=8)
    q_, k_, v_, do = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V, dO))
    per_token = 2 * 1 * (8 + 8) * 4  # batch 2, one K/V head, K and V, float32
    sent = {}
    for mode in ("sparse", "ring"):
        fwd, bwd = Record(), Record()
        out, lse = ring_attention(q_, k_, v_, comm, layout=layout, mode=mode, mask=sel, record=fwd)
        ring_attention_backward(do, q_, k_, v_, out, lse, comm, layout=layout, mode=mode, mask=sel, record=bwd)
        sent[mode] = comm.allgather((fwd.bytes_sent, bwd.bytes_sent))
    r = comm.rank
    assert sent["sparse"][r][0] == sum(wanted[j][r] for j in range(P)) * per_token  # r's keys each user chose
    assert sent["sparse"][r][1] == sent["sparse"][r][0] + sum(wanted[r]) * per_token  # and the partials home
    assert sum(f for f, _ in sent["sparse"]) <= sum(f for f, _ in sent["ring"])
    if P > 1 and layout == "contiguous":
        assert sum(f for f, _ in sent["sparse"]) < sum(f for f, _ in sent["ring"])


def test_bad_input_raises_on_every_rank(comm):
    S = 4 * comm.size + 1
    q, k, kh, w = _indexer(S)
    rows = shard_indices(S, comm.size, comm.rank, "contiguous")
    bad = [(k, dict(topk=0 if comm.rank == comm.size - 1 else 2), "topk must be a positive integer"),
           (k, dict(topk=2, indexer="mean"), "index_k must have 2 heads for indexer 'mean'"),
           (kh, dict(topk=2, indexer="mean", weights=w[:, rows]), "weights must be an array"),
           (k, dict(topk=2, block=-1), "block must be a positive integer")]
    for keys, options, message in bad:
        with pytest.raises(ValueError, match=message):
            select_topk(q[:, rows], keys[:, rows], comm, seq_len=S, **options)
    nan = q[:, rows].copy()
    nan[..., 0] = np.nan if comm.rank == 0 else 0
    with pytest.raises(ValueError, match="index_q has NaN"):
        select_topk(nan, k[:, rows], comm, seq_len=S, topk=2)
    sel = select_topk(q[:, rows], k[:, rows], comm, seq_len=S, topk=2)
    other = S + comm.size
    x = np.zeros((1, len(shard_indices(other, comm.size, comm.rank)), 4))
    rec = Record()
    with pytest.raises(ValueError, match=f"chose blocks for {S} query positions, but the sequence has {other}"):
        ring_attention(x, x, x, comm, mask=sel, record=rec)
    assert rec.bytes_sent == 0


def test_decoding_refuses_a_choice_made_for_the_prompt(comm):
    """New tokens past the positions a choice covers would see nothing: refused on every rank."""
    import mpiring

    S = 3 * comm.size + 1
    q, k, _, _ = _indexer(S)
    rows = shard_indices(S, comm.size, comm.rank)
    sel = select_topk(q[:, rows], k[:, rows], comm, seq_len=S, topk=2)
    x = np.zeros((1, 2, 1, 4))
    mine = np.arange(comm.rank, S + 1, comm.size)
    kv = np.zeros((1, 1, len(mine), 4))
    with pytest.raises(ValueError, match=f"chose blocks for {S} query positions, but the sequence has {S + 1}"):
        mpiring.decode_attention(x, kv, kv, comm, mask=sel, positions=[S], kv_positions=mine)
