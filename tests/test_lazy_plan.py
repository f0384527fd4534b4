"""A rank plans its own steps in O(P) (issue 34); the plan is the one every rank used to build whole, entry for entry.

    python -m pytest -q tests/test_lazy_plan.py

``brute`` builds, the way the plan was built before, every rank's block
kinds and pairs (P x P masks), the early stop of every stream (every offset
checked on every rank), the schedule and the row runs; the lazy plan must
give the same values on seeded random problems: layouts, balanced and random
positions, a longer K/V, every mask, every ring mode, P = 1..12.
"""

import time

import numpy as np
import pytest

from mpiring import balance, make_plan
from mpiring.parallel.passq import q_rounds
from mpiring.plans.plan import MODES, NEXT, PREV, reach
from mpiring.plans.visibility import block_kind, visible_keys

MAX_RUNS = 32


def _position_runs(shards):
    """The row runs as plans.layouts.position_runs made them for every rank at once before issue 34."""
    bounds = [[0, *(np.flatnonzero(np.diff(s) != 1) + 1).tolist(), len(s)] for s in shards]
    lengths = sorted(b - a for bs in bounds for a, b in zip(bs, bs[1:]))
    unit = lengths[(len(lengths) - 1) // 2]
    runs = []
    for s, bs in zip(shards, bounds):
        if len(bs) - 1 > min(MAX_RUNS, max(2, len(s) // 2)):
            runs.append([(0, len(s))])
            continue
        mine = []
        for a, b in zip(bs, bs[1:]):
            n, parts = b - a, max(1, int((b - a) / unit + 0.5))
            mine += [(a + -(-i * n // parts), a + -(-(i + 1) * n // parts)) for i in range(parts)]
        runs.append(mine if len(mine) <= MAX_RUNS else [(a, b) for a, b in zip(bs, bs[1:])])
    return runs


def brute(plan):
    """``(kinds, pairs, rounds, table, runs, q_rounds)`` computed for every rank, as before issue 34."""
    P = plan.size
    shards, kv = [plan.shards[r] for r in range(P)], [plan.kv_shards[r] for r in range(P)]
    kinds, pairs = [], []
    for r in range(P):
        row_k, row_p = [], []
        for j in range(P):
            klo, khi = visible_keys(shards[r], kv[j], causal=plan.causal, window=plan.window,
                                    cu_seqlens=plan.cu_seqlens, causal_block=plan.causal_block)
            kind, n = block_kind(klo, khi, len(kv[j]))
            row_k.append(kind)
            row_p.append(len(shards[r]) * len(kv[j]) if n is None else n)
        kinds.append(row_k)
        pairs.append(row_p)

    def last_needed(stream, max_step):
        return max([s for s in range(1, max_step + 1)
                    if any(kinds[r][(r - stream * s) % P] != "skip" for r in range(P))], default=0)

    rounds = {"ring": {NEXT: last_needed(NEXT, P - 1)},
              "bidirectional": {NEXT: last_needed(NEXT, P // 2), PREV: last_needed(PREV, (P - 1) // 2)},
              "allgather": {}}[plan.mode]
    n_steps = P if plan.mode == "allgather" else 1 + max(rounds.values(), default=0)
    table = []
    for step in range(n_steps):
        row = []
        for r in range(P):
            streams = [NEXT] if step == 0 or plan.mode == "allgather" else [d for d in rounds if step <= rounds[d]]
            row.append(tuple((j, kinds[r][j], d) for d in streams for j in [(r - d * step) % P]))
        table.append(row)
    q = max([s for s in range(P) if any(kinds[(r - s) % P][r] != "skip" for r in range(P))], default=0)
    return kinds, pairs, rounds, table, _position_runs(shards), q


def _problems(seed):
    rng = np.random.default_rng(seed)
    for _ in range(60):
        P = int(rng.integers(1, 13))
        S = int(rng.integers(P, 12 * P + 8))
        mask = {}
        if rng.random() < 0.6:
            mask["causal"] = True
            if rng.random() < 0.3:
                mask["causal_block"] = int(rng.integers(1, 9))
        if rng.random() < 0.4:
            mask["window"] = (int(rng.integers(-1, S // 2 + 2)), int(rng.integers(-1, 4)) if "causal" not in mask
                              else 0)
        if rng.random() < 0.3:
            cuts = np.sort(rng.choice(np.arange(1, S), size=min(S - 1, int(rng.integers(1, 5))), replace=False))
            mask["cu_seqlens"] = np.concatenate([[0], cuts, [S]])
        held = {}
        kind = rng.integers(0, 4)
        if kind == 0:
            held["layout"] = str(rng.choice(["contiguous", "zigzag", "striped"]))
        elif kind == 1:
            held["positions"] = balance(S, P, method=str(rng.choice(["zigzag", "headtail", "greedy"])),
                                        **{k: v for k, v in mask.items() if k != "window"})
        else:
            order = rng.permutation(S)
            cuts = np.sort(rng.choice(np.arange(1, S), size=P - 1, replace=False)) if P > 1 else []
            held["positions"] = np.split(order, cuts)
            if kind == 3:  # queries against a longer K/V: a subset of the positions, at least one per rank
                keep = [p[: max(1, len(p) // 2)] for p in held["positions"]]
                held = {"positions": keep, "kv_positions": np.split(rng.permutation(S), cuts)}
        yield S, P, dict(mask, **held, mode=str(rng.choice(MODES)))


@pytest.mark.parametrize("seed", range(4))
def test_the_lazy_plan_is_the_whole_plan(seed):
    for S, P, options in _problems(seed):
        plan = make_plan(S, P, **options)
        kinds, pairs, rounds, table, runs, q = brute(plan)
        assert plan.rounds == rounds, (S, P, options)
        assert [[plan.kinds[r][j] for j in range(P)] for r in range(P)] == kinds
        assert [[plan.pairs[r][j] for j in range(P)] for r in range(P)] == pairs
        assert plan.visible_pairs() == [sum(row) for row in pairs]
        assert [[[(t.source, t.kind, t.stream) for t in tasks] for tasks in row] for row in plan.schedule.table] \
            == [[list(tasks) for tasks in row] for row in table]
        assert [plan.runs[r] for r in range(P)] == runs
        assert q_rounds(plan) == q
        listed = reach(plan)  # both ways of finding the offsets give the same: every pair listed, one offset checked
        if listed._offsets is not None:
            listed._offsets, found = None, listed._offsets
            assert [listed.needed(o) for o in range(P)] == found.tolist()


def test_a_rank_plans_only_its_own_row():
    """make_plan makes no rank's row; a rank's steps make its own and nobody else's (the pair cache tells)."""
    P = 512
    plan = make_plan(64 * P, P, causal=True, layout="zigzag")
    assert not plan.kinds._rows._got  # nothing made yet
    for step in range(plan.n_steps):
        for task in plan.tasks(step, 7):
            plan.pieces(7, task.source)
    assert list(plan.kinds._rows._got) == [7] and len(plan.kinds[7]._got) == P


def test_make_plan_at_1024_ranks_takes_under_a_tenth_of_a_second():
    start = time.process_time()
    plan = make_plan(256 * 1024, 1024, causal=True, layout="zigzag")
    assert plan.n_steps == 1024
    assert time.process_time() - start < 0.1


def test_planbench_prints_a_row_per_size(capsys):
    from mpiring.__main__ import main

    assert main(["planbench", "-P", "4", "16", "--repeats", "1", "--causal", "--layout", "zigzag"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |") or
            line.startswith("| 16 |")]
    assert len(rows) == 2 and rows[1].split("|")[5].strip() == "16"  # 16 steps
