"""The Ulysses plan and its bytes (no MPI), and ``run``/``schedule`` with ``--mode ulysses``."""

import itertools
import subprocess
import sys

import numpy as np
import pytest

from mpiring import LAYOUTS, make_plan
from mpiring.__main__ import main
from mpiring.core.reference import definition_mask
from mpiring.cost.nodes import predicted_bytes
from mpiring.plans.heads import deal_heads, heads_problem

from launch import MPIEXEC, clean_env, mpiexec_argv


@pytest.mark.parametrize("P", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_rank_does_every_visible_pair_once_for_its_heads(P, layout):
    S = 6 * P + 5
    plan = make_plan(S, P, layout=layout, mode="ulysses", causal=True, window=(7, 0))
    ring = make_plan(S, P, layout=layout, causal=True, window=(7, 0))
    assert plan.n_steps == 1 and plan.rounds == {}
    assert plan.visible_pairs() == [sum(ring.visible_pairs())] * P  # the whole sequence's, for its heads
    gathered = np.concatenate(plan.shards)  # positions in the order the all-to-all leaves them
    ordered = gathered if plan.order() is None else gathered[plan.order()]  # ... and once the rank sorts them
    np.testing.assert_array_equal(ordered, np.arange(S))
    seen = np.zeros((S, S), int)
    for j in range(P):
        keys = ordered[plan.key_block(j)]
        pieces = plan.block_pieces(j)
        assert len(pieces) == 1 and plan.tasks(0, j % P)[j].kind == "masked"  # one kernel call per key block
        for a, b, c, d, klo, khi, _ in pieces:
            for row in range(a, b):
                lo, hi = (c, d) if klo is None else (c + klo[row - a], c + khi[row - a])
                seen[ordered[row], keys[lo:hi]] += 1
    i, j = np.meshgrid(np.arange(S), np.arange(S), indexing="ij")
    np.testing.assert_array_equal(seen, ((j <= i) & (j >= i - 7)).astype(int))
    assert plan.computed_pairs() == [sum((p.q1 - p.q0) * (p.k1 - p.k0) for j in range(P)
                                         for p in plan.block_pieces(j))] * P


OPTIONS = [dict(), dict(causal=True), dict(causal=True, window=(5, 0)), dict(window=(2, 3)),
           dict(cu_seqlens=[0, 7, 20, 21]), dict(causal=True, causal_block=4), dict(causal=True, cu_seqlens=[0, 9, 40])]


@pytest.mark.parametrize("P", [1, 3, 4])
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("layout", LAYOUTS + ("positions",))
def test_block_pieces_cover_every_visible_pair_of_the_sorted_sequence_once(P, options, layout):
    """Whatever the layout and mask: key block j's one piece (or none) covers exactly its visible pairs, the
    kinds say which blocks are skipped or full, and the counts agree with the pieces."""
    S = 40 if options.get("cu_seqlens", [0, 40])[-1] == 40 else 21
    rng = np.random.default_rng([P, S, len(options)])
    if layout == "positions":  # scattered queries against a partition of the keys of their own
        perm, keys = rng.permutation(S), rng.permutation(S)
        queries = np.sort(perm[:S - P])
        kw = dict(positions=[queries[r::P] for r in range(P)], kv_positions=[keys[r::P] for r in range(P)])
    else:
        kw = dict(layout=layout)
    plan = make_plan(S, P, mode="ulysses", **kw, **options)
    q_pos = np.sort(np.concatenate(plan.shards))
    k_pos = np.sort(np.concatenate(plan.kv_shards))
    for kv, pos in ((False, q_pos), (True, k_pos)):
        gathered = np.concatenate(plan.kv_shards if kv else plan.shards)
        order = plan.order(kv)
        np.testing.assert_array_equal(gathered if order is None else gathered[order], pos)
    window = options.get("window")
    want = definition_mask(q_pos, k_pos, causal=options.get("causal", False), window=window,
                           cu_seqlens=options.get("cu_seqlens"), causal_block=options.get("causal_block"))
    seen = np.zeros(want.shape, int)
    for j, task in enumerate(plan.tasks(0, P - 1)):
        block = plan.key_block(j)
        pieces = plan.block_pieces(j)
        assert task.source == j and len(pieces) <= 1
        sees = want[:, block]
        kind = "skip" if not sees.any() else "full" if sees.all() else "masked"
        assert task.kind == kind and (kind == "skip") == (not pieces)
        for a, b, c, d, klo, khi, _ in pieces:
            assert (klo is None) == bool(sees[a:b, c:d].all())
            for row in range(a, b):
                lo, hi = (c, d) if klo is None else (c + klo[row - a], c + khi[row - a])
                seen[row, block.start + lo:block.start + hi] += 1
    np.testing.assert_array_equal(seen, want.astype(int))
    assert plan.visible_pairs() == [int(want.sum())] * P
    assert plan.computed_pairs() == [sum((p.q1 - p.q0) * (p.k1 - p.k0) for j in range(P)
                                         for p in plan.block_pieces(j))] * P


@pytest.mark.parametrize("layout", ["zigzag", "striped"])
def test_ulysses_calls_the_kernel_at_most_once_per_key_block(layout):
    """Issue 34: with zigzag or striped shards in shard order Ulysses gave the kernel a piece per query shard
    and key block, 6,176 at P = 64 (causal zigzag). Sorted, one piece per key block: at most P a pass."""
    P = 64
    plan = make_plan(256 * P, P, layout=layout, mode="ulysses", causal=True)
    assert sum(len(plan.block_pieces(t.source)) for t in plan.tasks(0, 5)) == P
    visible = plan.visible_pairs()[0]
    assert visible < plan.computed_pairs()[0] < visible * (1 + 1.5 / P)  # the pieces hug the causal triangle


def test_heads_split_and_kv_heads_replicated_when_fewer_than_ranks():
    def runs(slices):
        return [(s.start, s.stop) for s in slices]

    assert runs(deal_heads(8, 8, 4).q) == runs(deal_heads(8, 8, 4).kv) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert runs(deal_heads(8, 2, 4).kv) == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert runs(deal_heads(8, 1, 4).kv) == [(0, 1)] * 4
    # uneven: 4 heads over 3 ranks, 6 over 4; 8 query heads in 2 groups over 3 ranks: the middle rank takes
    # one head of each group (3, 2, 3 rather than 3, 3, 2, which would give it 1 and 2: an uneven ratio)
    assert deal_heads(4, 4, 3).counts() == [2, 1, 1] and deal_heads(6, 6, 4).counts() == [2, 2, 1, 1]
    deal = deal_heads(8, 2, 3)
    assert runs(deal.q) == [(0, 3), (3, 5), (5, 8)] and runs(deal.kv) == [(0, 1), (0, 2), (1, 2)]
    assert deal.held == (None, None, None)
    deal = deal_heads(6, 3, 2)  # 3 heads each: rank 0 has 2 of group 0 and 1 of group 1
    assert runs(deal.kv) == [(0, 2), (1, 3)] and deal.held == ((0, 0, 1), (0, 1, 1))
    k = np.arange(2.0).reshape(2, 1, 1)
    assert deal.expand(0, k).ravel().tolist() == [0, 0, 1]
    assert deal.fold(0, np.ones((3, 1, 1))).ravel().tolist() == [2, 1]
    with pytest.raises(ValueError, match="cannot deal 3 query heads, 1 K/V heads over 4 ranks"):
        deal_heads(3, 1, 4)


def _old_even_deal(hq, hk, P):
    """The only deal before uneven heads (Hq divisible by P, Hk dividing or divisible by P), written out."""
    q = [(r * hq // P, (r + 1) * hq // P) for r in range(P)]
    kv = [(r * hk // P, (r + 1) * hk // P) if hk >= P else (r * hk // P, r * hk // P + 1) for r in range(P)]
    return q, kv


def _sent_and_held(runs, group):
    """K/V heads sent (each rank's distinct ones) and held (repeated to one ratio) of a list of runs."""
    sent = held = 0
    for a, b in runs:
        uses = [len([h for h in range(a, b) if h // group == c]) for c in range(a // group, (b - 1) // group + 1)]
        sent += len(uses)
        held += len(uses) if len(set(uses)) == 1 else sum(u // np.gcd.reduce(uses) for u in uses)
    return sent, held


@pytest.mark.parametrize("hq", range(1, 17))
def test_any_head_count_is_dealt_evenly_keeping_groups_whole(hq):
    """Every hq from 1 to 16, every hk dividing it, every P up to hq (and 9): contiguous runs of hq // P or one
    more heads; each rank's K/V heads are exactly those its queries use, and ``held`` maps local query head i to
    the global K/V head it uses; the deal sends the fewest K/V heads of all even deals (then holds the fewest,
    then puts the longer runs first: by brute force); the even deal of before is unchanged."""
    for hk in (h for h in range(1, hq + 1) if hq % h == 0):
        group = hq // hk
        for P in range(1, min(hq, 9) + 1):
            deal = deal_heads(hq, hk, P)
            runs = [(s.start, s.stop) for s in deal.q]
            assert runs[0][0] == 0 and runs[-1][1] == hq and all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
            assert max(deal.counts()) - min(deal.counts()) <= 1 and min(deal.counts()) >= 1
            for r, ((a, b), kv, held) in enumerate(zip(runs, deal.kv, deal.held)):
                assert (kv.start, kv.stop) == (a // group, (b - 1) // group + 1)
                used = np.arange(a, b) // group - kv.start  # the K/V head (in the slice) each query head uses
                local = np.arange(kv.stop - kv.start) if held is None else np.array(held)
                assert (b - a) % len(local) == 0
                np.testing.assert_array_equal(local[np.arange(b - a) // ((b - a) // len(local))], used)
                assert deal.held_counts()[r] == len(local)
            base, extra = divmod(hq, P)
            options = []
            for longer in itertools.combinations(range(P), extra):
                ends = np.cumsum([base + (r in longer) for r in range(P)])
                options.append((*_sent_and_held(zip([0, *ends[:-1]], ends), group), list(longer)))
            assert _sent_and_held(runs, group) + ([r for r, c in enumerate(deal.counts()) if c > base],) \
                == min(options), (hq, hk, P)
            if hq % P == 0 and (hk % P == 0 or P % hk == 0):
                assert (runs, [(s.start, s.stop) for s in deal.kv]) == _old_even_deal(hq, hk, P)


def test_bytes_by_hand():
    """P = 4, S = 64 (n = 16), B = 1, Hq = 8, D = Dv = 4, float32: each of the 3 other ranks gets ..."""
    plan = make_plan(64, 4, mode="ulysses")
    q_out = 3 * 16 * 2 * 4  # ... its 2 query heads of my 16 tokens
    results = 3 * 16 * 2 * (4 + 1)  # ... and back its tokens of my 2 heads: out and lse
    for hk, kv in ((8, 2), (4, 1), (2, 1), (1, 1)):  # K/V heads each rank gets: Hk/P, or one replica
        assert predicted_bytes(plan, batch=1, hq=8, hk=hk, dim=4, dim_v=4, itemsize=4) == \
            [4 * (q_out + 3 * 16 * kv * 8 + results)] * 4
    grads = 3 * 16 * (2 * 4 + 1 * 8) * 4  # back: dq (2 heads) and the dK, dV of one K/V head, float32 by default
    assert predicted_bytes(plan, batch=1, hq=8, hk=2, dim=4, dim_v=4, itemsize=4, backward=True) == \
        [4 * 3 * 16 * (2 * (4 + 4 + 2) + 8) + grads] * 4
    assert predicted_bytes(plan, batch=1, hq=8, hk=2, dim=4, dim_v=4, itemsize=4, backward=True, grad_itemsize=8) == \
        [4 * 3 * 16 * (2 * (4 + 4 + 2) + 8) + 2 * grads] * 4  # grad_wire_dtype="float64"
    int8 = 3 * 16 * 1 * 2 * (4 + 4)  # an int8 wire: the K/V head's rows of 4 values and a 4-byte scale, 1 byte each
    assert predicted_bytes(plan, batch=1, hq=8, hk=2, dim=4, dim_v=4, itemsize=4, wire_dtype="int8") == \
        [4 * (q_out + results) + int8] * 4
    ring = make_plan(64, 4)
    assert predicted_bytes(ring, batch=1, hq=8, hk=2, dim=4, dim_v=4, itemsize=4) == [3 * 16 * 2 * 8 * 4] * 4
    # 4 heads over P = 3 (n = 16): rank 0 attends 2 heads, ranks 1 and 2 one; per other rank, rank 0 sends its
    # 1 query head and 1 K/V head of my 16 tokens, and back its tokens of my 2 heads; ranks 1, 2 send rank 0
    # 2 query and 2 K/V heads, back 1 head, and each other 1, 1, back 1
    uneven = make_plan(48, 3, mode="ulysses")
    assert predicted_bytes(uneven, batch=1, hq=4, hk=4, dim=4, dim_v=4, itemsize=4) == \
        [2 * 16 * (1 * 4 + 1 * 8 + 2 * 5) * 4] + [16 * (2 * 4 + 2 * 8 + 1 * 5 + 1 * 4 + 1 * 8 + 1 * 5) * 4] * 2


def test_heads_problems():
    from mpiring import Spec

    q, k = np.zeros((1, 6, 4, 2)), np.zeros((1, 2, 4, 2))
    ulysses = Spec.of(mode="ulysses")
    assert Spec.of(mode="ring").heads_problem(q, k, 4) is None
    assert ulysses.heads_problem(q, k, 4) is None and ulysses.heads_problem(q, k, 3) is None  # any count
    assert ulysses.heads_problem(q, k, 7) == ("mode='ulysses' needs at least one query head per part: 6 query "
                                              "heads for the number of ranks (7); the ring modes take any number "
                                              "of heads")
    assert ulysses.heads_problem(q, k, 6) is None and ulysses.heads_problem(q, k, 2) is None
    assert "splits the heads axis" in ulysses.heads_problem(q[0, 0], k[0, 0], 2)
    assert ulysses.heads_problem(q[0, 0], k[0, 0], 1) is None
    assert ulysses.heads_problem("not an array", k, 2) is None  # local_problem reports that one
    grid = Spec.of(ulysses_size=2)
    assert grid.heads_problem(q, k, 3) == "ulysses_size 2 does not divide the 3 ranks"
    assert grid.heads_problem(q, k, 4) is None and Spec.of(ulysses_size=4).heads_problem(q, k, 4) is None
    assert Spec.of(ulysses_size=8).heads_problem(q, k, 8) == ("ulysses_size 8 needs at least one query head per "
                                                              "part: 6 query heads for ulysses_size (8); the ring "
                                                              "modes take any number of heads")
    assert "combines with mode ring" in Spec.of(ulysses_size=2, mode="ulysses").heads_problem(q, k, 4)
    assert heads_problem(q, k, 2, "who", "the parts") is None


def test_schedule_command(capsys):
    assert main(["schedule", "-P", "3", "--mode", "ulysses", "--causal", "--layout", "zigzag"]) == 0
    text = capsys.readouterr().out
    assert "mode=ulysses" in text and "steps=1 messages/rank=4" in text and "0m,1m,2m" in text


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("extra", [[], ["--backward"]])
def test_run_verifies(extra):
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "run", "--mode", "ulysses", "--seq-len", "200",
                       "--heads", "4", "--kv-heads", "1", "--dim", "8", "--causal", "--layout", "zigzag", *extra)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VERIFIED" in result.stdout and "recorded schedule equals the plan: yes" in result.stdout


def test_the_grid_plan():
    """u = 2 over P = 4, zigzag: every rank holds its zigzag shard; a group's tokens are its 2 members'."""
    from mpiring import shard_indices
    from mpiring.plans.heads import sequence_pairs

    plan = make_plan(40, 4, layout="zigzag", causal=True, ulysses_size=2)
    assert [list(s) for s in plan.shards] == [list(shard_indices(40, 4, r, "zigzag")) for r in range(4)]
    # group 0: chunks 0, 1 and their mirrors 7, 6 of 5 tokens; group 1: chunks 2, 3, 5, 4
    assert list(plan.group_positions(0)) == [*range(5), *range(35, 40), *range(5, 10), *range(30, 35)]
    groups = make_plan(40, 2, causal=True, positions=[plan.group_positions(g) for g in range(2)])
    assert plan.ring_plan.visible_pairs() == groups.visible_pairs() == [410, 410]  # zigzag: balanced groups
    assert plan.n_steps == groups.n_steps and plan.tasks(1, 3) == groups.tasks(1, 1)
    assert sequence_pairs(plan) == sequence_pairs(groups) == 40 * 41 // 2
    assert plan.messages_per_rank() == 2 + 2  # the group's all-to-alls, the ring's K and V
    shape = dict(batch=1, hq=4, hk=2, dim=4, dim_v=4, itemsize=4)
    # to the other member: its 2 query heads and 1 K/V head of my 10 tokens, then its 10 tokens of my 2 heads
    # (out and lse); across: the group's 20 tokens of my 1 K/V head
    assert predicted_bytes(plan, **shape) == [4 * (10 * (2 * 4 + 1 * 8) + 10 * 2 * 5 + 20 * 8)] * 4
    with pytest.raises(ValueError, match="ulysses_size 3 does not divide the 4 ranks"):
        make_plan(40, 4, ulysses_size=3)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_run_verifies_the_grid():
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "run", "--ulysses-size", "2", "--seq-len", "128",
                       "--heads", "2", "--dim", "8", "--causal", "--layout", "zigzag", "--backward")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VERIFIED" in result.stdout and "mode=ring ulysses_size=2" in result.stdout
