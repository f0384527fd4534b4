"""The inference time model (``mpiring.cost.infercost``): decode merges, prefill rotations, ``cost`` printing them."""

import contextlib
import io

import numpy as np
import pytest

from mpiring.cost.costmodel import Machine
from mpiring.cost.infercost import (
    _crossover,
    choose_rotate,
    decode_time,
    helix_time,
    meta_rule,
    prefill_bytes,
    prefill_time,
    relayout_bytes,
)
from mpiring.tools.cli_plan import cost

LINK = Machine("test", 1e12, 1e-5, 1e10)


@pytest.mark.parametrize("P,tree,ring", [(1, 0, 0), (2, 1, 1), (3, 2, 2), (4, 2, 3), (8, 3, 7), (9, 4, 8)])
def test_decode_transfers_log2_vs_ring(P, tree, ring):
    t = decode_time(4096, P, heads=8, head_dim=64, machine=LINK, merge="tree")
    r = decode_time(4096, P, heads=8, head_dim=64, machine=LINK, merge="ring")
    assert (t["transfers"], r["transfers"]) == (tree, ring)
    assert t["partial_bytes"] == 8 * 65 * 8  # heads x (dim + lse) float64
    assert t["merge_s"] == pytest.approx(tree * (1e-5 + t["partial_bytes"] / 1e10))
    assert t["compute_s"] == r["compute_s"] == pytest.approx(4 * 8 * -(-4096 // P) * 64 / 1e12)


def test_prefill_bytes_and_the_crossover():
    kw = dict(heads=32, kv_heads=8, head_dim=128, bytes_per_element=2)
    b = prefill_bytes(1000, 3000, 4, **kw)
    assert b["kv"] == 3 * 8 * 256 * 2 * 4000 / 4
    assert b["q"] == 3 * (32 * 128 * 2 * 1000 / 4 + 32 * 129 * 8 * 1000 / 4)
    x = _crossover(32, 8, 128, 2)
    total = 100_000
    for frac in (x * 0.9, x * 1.1):
        T = round(total * frac)
        assert choose_rotate(T, total - T, 4, **kw) == ("kv" if frac > x else "q")
    assert meta_rule(50, 50, heads=32, kv_heads=8) == "kv" and meta_rule(49, 51, heads=32, kv_heads=8) == "q"
    slow = Machine("slow link", 1e12, 1e-5, 1e8)  # transfer-bound: the smaller messages win
    kv = prefill_time(100, 99_900, 4, rotate="kv", machine=slow, **kw)
    q = prefill_time(100, 99_900, 4, rotate="q", machine=slow, **kw)
    assert q["total_s"] < kv["total_s"] and q["home_s"] > 0 and kv["home_s"] == 0


def test_cost_prints_the_inference_model():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cost(None, ["--seq-len", "65536", "-P", "4", "--hidden", "512", "--heads", "16", "--dim", "64"]) == 0
    text = out.getvalue()
    assert "decode, 1 new token(s) against a cache of 65536" in text
    assert "  tree    2 transfers" in text and "  ring    3 transfers" in text
    assert f"Meta's rule 2 Hkv / Hq = {2 * 8 / 16:.3g}" in text


def test_the_plans_bytes_are_the_models():
    """``passq.plan_bytes`` (from a plan, what ``rotate="auto"`` uses) equals the formula of ``infercost``."""
    from mpiring import make_plan
    from mpiring.parallel.passq import plan_bytes

    P, T, C = 4, 32, 96
    q_pos = [np.arange(C + r, C + T, P) for r in range(P)]
    kv_pos = [np.arange(r, C + T, P) for r in range(P)]
    plan = make_plan(C + T, P, positions=q_pos, kv_positions=kv_pos)  # no mask: every block is visible
    got = plan_bytes(plan, 2 * 8, 4, 16, 16, 4)  # batch 2 x 8 heads, 2 K/V heads, D 16, float32
    want = prefill_bytes(T, C, P, heads=8, kv_heads=2, head_dim=16, batch=2, bytes_per_element=4)
    assert got == {"kv": want["kv"], "q": want["q"]}


def test_helix_overlap_hides_the_smaller_of_compute_and_all_to_all():
    m = Machine("test", flops=1e12, alpha=1e-5, beta=1e10)
    kw = dict(heads=32, head_dim=128, batch=8, machine=m)
    one = helix_time(1 << 20, 4, 2, chunks=1, **kw)
    assert one["overlap_s"] == pytest.approx(one["serial_s"]) and one["bytes"] == 3 * 8 * 4 * 129 * 8
    hop = helix_time(1 << 20, 4, 2, chunks=4, **kw)
    c, a = hop["compute_s"] / 4, hop["alltoall_s"] / 4
    assert hop["overlap_s"] == pytest.approx(c + 3 * max(c, a) + a) and hop["overlap_s"] < hop["serial_s"]
    assert hop["bytes"] == one["bytes"]  # HOP-B cuts the batch, not the bytes
    assert helix_time(1000, 1, 4, chunks=2, **kw)["alltoall_s"] == 0  # KVP = 1: nothing to exchange


def test_relayout_moves_each_token_once_to_its_new_owner():
    held = [np.array([0, 1, 6, 7]), np.array([2, 3, 4, 5])]  # zigzag over 2 ranks
    assert relayout_bytes(held, lambda p: p % 2, 10) == [20, 20]  # round-robin: 1 and 6; 2 and 4 stay
    assert relayout_bytes(held, lambda p: p // 4, 10) == [20, 20]
    assert relayout_bytes(held, lambda p: np.where(np.isin(p, held[0]), 0, 1), 10) == [0, 0]
