"""The alpha-beta time model against hand-computed cases.

    python -m pytest --with-mpi -q tests/test_timemodel.py
    mpiexec -n 2 python -m pytest --with-mpi -m mpi -q tests/test_timemodel.py
"""

import pytest

from mpiring import make_plan
from mpiring.__main__ import main
from mpiring.cost.costmodel import (
    PRESETS,
    Machine,
    block_flops,
    format_time_model,
    format_wire_model,
    predict_plan,
    time_model,
)
from mpiring.tools.calibrate import calibrate

# a round machine: 1 TFLOP/s, 10 GB/s, 10 us
M = Machine("round", 1e12, 1e-5, 1e10)
# S = 4096 tokens on P = 4: n = 1024 per device, one head of dim 64, 2-byte elements
C = 4 * 1024 * 1024 * 64 / 1e12  # one full block: 2.68435456e-4 s
KV = 2 * 1024 * 64 * 2  # one K/V block: 262144 bytes
T = 1e-5 + KV / 1e10  # its transfer: 3.62144e-5 s


def model(**kw):
    args = dict(heads=1, head_dim=64, machine=M)
    return time_model(4096, 4, **(args | kw))


def test_hand_numbers():
    assert block_flops(1024, 1024, 1, 64) == 4 * 1024**2 * 64
    r = model()
    assert r["block_compute_s"] == pytest.approx(C) and r["block_bytes"] == KV
    assert r["compute_s"] == pytest.approx([C] * 4)
    assert r["transfer_s"] == pytest.approx([T, T, T, 0])
    assert r["total_s"] == pytest.approx(4 * C)  # compute-bound: the transfers hide
    assert r["efficiency"] == pytest.approx(1.0) and not r["comm_bound"]


def test_causal_layouts():
    contiguous = model(causal=True, variant="contiguous")
    assert contiguous["compute_s"] == pytest.approx([C / 2, C, C, C])  # the last rank does full blocks
    assert contiguous["total_s"] == pytest.approx(3.5 * C)
    assert contiguous["efficiency"] == pytest.approx(2 * C / (3.5 * C))  # half the pairs are visible
    for layout in ("zigzag", "striped"):
        balanced = model(causal=True, variant=layout)
        assert balanced["compute_s"] == pytest.approx([C / 2] * 4)
        assert balanced["total_s"] == pytest.approx(2 * C)


def test_bidirectional_and_allgather():
    bi = model(variant="bidirectional")
    T2 = 1e-5 + 2 * KV / 1e10  # both sends share the device's bandwidth
    assert bi["steps"] == 3
    assert bi["compute_s"] == pytest.approx([C, 2 * C, C])
    assert bi["transfer_s"] == pytest.approx([T2, T, 0])
    assert bi["total_s"] == pytest.approx(4 * C)
    ag = model(variant="allgather")
    assert ag["transfer_s"] == pytest.approx([3 * T, 0, 0, 0])
    assert ag["total_s"] == pytest.approx(max(C, 3 * T) + 3 * C)


def test_communication_bound():
    slow = Machine("slow link", 1e12, 1e-5, 1e8)  # 100 MB/s: T = 10 us + 2.62 ms
    r = time_model(4096, 4, heads=1, head_dim=64, machine=slow)
    t = 1e-5 + KV / 1e8
    assert r["total_s"] == pytest.approx(3 * t + C) and r["comm_bound"]
    assert r["step_time_s"] == pytest.approx(t)


def test_gqa_and_backward():
    gqa = time_model(4096, 4, heads=8, kv_heads=2, head_dim=64, machine=M)
    assert gqa["block_compute_s"] == pytest.approx(8 * C)
    assert gqa["block_bytes"] == 2 * KV  # only the 2 K/V heads travel
    bwd = model(backward=True)
    assert bwd["compute_s"] == pytest.approx([2.5 * C] * 4)
    assert bwd["transfer_s"][0] == pytest.approx(1e-5 + 3 * KV / 1e10)  # K, V (2 bytes) and dK, dV (float32)
    assert bwd["total_s"] == pytest.approx(4 * 2.5 * C + 1e-5 + 2 * KV / 1e10)  # plus dK/dV going home
    same = model(backward=True, grad_bytes_per_element=2)  # partials as small as K/V: twice the forward's bytes
    assert same["transfer_s"][0] == pytest.approx(1e-5 + 2 * KV / 1e10)
    assert same["total_s"] == pytest.approx(4 * 2.5 * C + T)


@pytest.mark.parametrize("variant,causal", [("contiguous", False), ("zigzag", True), ("bidirectional", False),
                                            ("allgather", True)])
def test_hide_threshold_balances_compute_and_transfer(variant, causal):
    for machine in PRESETS.values():
        r = time_model(1 << 20, 16, heads=32, head_dim=128, kv_heads=8, machine=machine, variant=variant,
                       causal=causal)
        n = r["hide_above_tokens"]
        a = 4 * 32 * 128 / machine.flops  # seconds per (query, key) pair
        per_token = 2 * 8 * 128 * 2  # K/V bytes per token
        if variant == "allgather":
            compute, transfer = (0.5 if causal else 1) * a * n * n, 15 * (machine.alpha + per_token * n / machine.beta)
        elif variant == "bidirectional":
            compute, transfer = 2 * a * n * n, machine.alpha + 2 * per_token * n / machine.beta
        else:
            compute, transfer = (0.5 if causal else 1) * a * n * n, machine.alpha + per_token * n / machine.beta
        assert compute == pytest.approx(transfer, rel=1e-9)


def test_presets_are_the_stated_numbers():
    assert (PRESETS["nvlink"].flops, PRESETS["nvlink"].beta, PRESETS["nvlink"].alpha) == (400e12, 450e9, 5e-6)
    assert (PRESETS["infiniband"].flops, PRESETS["infiniband"].beta, PRESETS["infiniband"].alpha) == \
        (400e12, 50e9, 10e-6)
    # H100 + NVLink, 128-dim heads, bf16: about a thousand tokens per device hide the ring
    r = time_model(1 << 20, 8, heads=32, head_dim=128, machine="nvlink")
    assert 800 < r["hide_above_tokens"] < 1200


def test_plan_prediction_matches_the_closed_form():
    full = predict_plan(make_plan(4096, 4), M, batch=1, heads=1, kv_heads=1, head_dim=64, itemsize=2)
    assert [c for c, _, _ in full] == pytest.approx([C] * 4)
    assert [t for _, t, _ in full] == pytest.approx([T, T, T, 0])
    zz = predict_plan(make_plan(4096, 4, layout="zigzag", causal=True), M, batch=1, heads=1, kv_heads=1,
                      head_dim=64, itemsize=2)
    assert [c for c, _, _ in zz[1:]] == pytest.approx([C / 2] * 3)  # after the diagonal: half blocks
    contiguous = predict_plan(make_plan(4096, 4, causal=True), M, batch=1, heads=1, kv_heads=1, head_dim=64,
                              itemsize=2)
    assert [c for c, _, _ in contiguous[1:]] == pytest.approx([C] * 3)  # the last rank: full blocks
    ag = predict_plan(make_plan(4096, 4, mode="allgather"), M, batch=1, heads=1, kv_heads=1, head_dim=64, itemsize=2)
    assert [t for _, t, _ in ag] == pytest.approx([3 * T, 0, 0, 0])


def test_bad_arguments():
    with pytest.raises(ValueError, match="variant"):
        model(variant="spiral")
    with pytest.raises(ValueError, match="multiple"):
        time_model(4096, 4, heads=6, kv_heads=4, head_dim=64)
    with pytest.raises(ValueError, match="num_devices"):
        time_model(4096, 0, heads=1, head_dim=64)


def test_calibration_is_quick_and_positive():
    m = calibrate(seconds=0.05, nbytes=1 << 20, tokens=128)
    assert m.flops > 1e6 and m.beta > 1e6 and 0 < m.alpha < 1e-2 and m.name == "this-machine"


@pytest.mark.mpi(min_size=2)
def test_calibration_over_the_ring():
    from mpi4py import MPI

    m = calibrate(MPI.COMM_WORLD, seconds=0.05, nbytes=1 << 20, tokens=128)
    values = MPI.COMM_WORLD.allgather((m.flops, m.alpha, m.beta))
    assert all(v == values[0] for v in values)  # every rank gets the same, slowest-rank numbers
    assert m.beta > 1e6 and "ranks" in m.note


def test_table_and_cli(capsys):
    text = format_time_model(1 << 20, 8, heads=32, head_dim=128, causal=True)
    for variant in ("contiguous", "zigzag", "striped", "bidirectional", "allgather"):
        assert text.count(variant) >= 2
    assert "nvlink" in text and "infiniband" in text and "backward" in text
    assert main(["cost", "--seq-len", "1024", "-P", "4", "--hidden", "64", "--heads", "8", "--causal",
                 "--flops", "1e12", "--bandwidth", "1e10"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].strip() == "chunk_length: 256"  # the cost report comes first
    assert "total_comm_bytes: 196608" in out and "time model" in out and "custom" in out
    assert out.index("total_comm_bytes") < out.index("time model")


def test_masked_blocks_at_their_own_rate():
    slow_mask = Machine("m", 1e12, 1e-5, 1e10, masked_flops=0.5e12)
    plan = make_plan(4096, 4, causal=True)  # the diagonal block (step 0) is masked, the others full
    steps = predict_plan(plan, slow_mask, batch=1, heads=1, kv_heads=1, head_dim=64, itemsize=2)
    assert [c for c, _, _ in steps] == pytest.approx([2 * C, C, C, C])


def test_wire_formats_win_only_where_the_transfer_is_exposed():
    """10 GbE at P = 8: the ring is transfer-bound, so int8 (1 + 4/64 bytes) beats bf16 by ~2/1.0625;
    NVLink with long shards hides every wire behind compute."""
    slow = time_model(8192, 8, heads=8, head_dim=64, machine="10gbe", causal=True, variant="zigzag",
                      bytes_per_element=1 + 4 / 64)
    bf16 = time_model(8192, 8, heads=8, head_dim=64, machine="10gbe", causal=True, variant="zigzag")
    assert slow["comm_bound"] and bf16["comm_bound"]
    assert slow["transfer_s"][0] == pytest.approx(30e-6 + 2 * 8 * 64 * 1024 * (1 + 4 / 64) / 1.25e9)
    text = format_wire_model(8192, 8, heads=8, head_dim=64, causal=True)
    assert "10gbe" in text and text.count("-> int8 wins") == 3  # short shards: int8 wins on every link
    text = format_wire_model(1 << 17, 8, heads=8, head_dim=64, causal=True)
    lines = [ln for ln in text.splitlines() if "->" in ln]
    assert "hide behind compute" in lines[0] and "hide behind compute" in lines[1]
    assert "int8 wins, 1.87x faster than bf16" in lines[2]
    with pytest.raises(ValueError, match="bytes_per_element must be a positive number"):
        time_model(8192, 8, heads=8, head_dim=64, bytes_per_element=0)
