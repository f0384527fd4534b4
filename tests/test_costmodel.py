"""The cost report, exactly as its contract: hand-computed cases, and the contract's own code on many inputs."""

import itertools

import pytest

from mpiring import make_plan, predicted_bytes_sent, ring_attention_context_parallel


def test_hand_computed_case():
    r = ring_attention_context_parallel(1024, 4, 64, 8)
    assert r == {
        "chunk_length": 256,
        "ring_steps": 4,
        "memory_per_gpu_bytes": 256 * 64 * 2 * 3,          # Q + K + V of one chunk
        "memory_per_gpu_mb": 0.09,                          # 98304 / 2**20 = 0.09375
        "full_kv_memory_bytes": 1024 * 64 * 2 * 2,
        "per_step_comm_bytes": 256 * 64 * 2 * 2,
        "total_comm_bytes": 3 * 65536,
        "total_comm_mb": 0.19,                              # 196608 / 2**20 = 0.1875
        "memory_savings_fraction": 0.75,
    }
    assert all(isinstance(r[k], int) for k in ("chunk_length", "total_comm_bytes", "memory_per_gpu_bytes"))


def test_video_scale_case():
    r = ring_attention_context_parallel(1_048_576, 8, 4096, 32, 2)
    assert r["chunk_length"] == 131072
    assert r["total_comm_bytes"] == 131072 * 4096 * 2 * 2 * 7
    assert r["memory_savings_fraction"] == round(1 - 1 / 8, 4)
    assert ring_attention_context_parallel(8, 1, 4, 1)["total_comm_bytes"] == 0


def _contract(total_seq_len, num_gpus, hidden_dim, num_heads, bytes_per_element=2):
    """The contract, as the problem statement gives its code (names and formulas unchanged)."""
    chunk_len = total_seq_len // num_gpus
    per_gpu_q_bytes = chunk_len * hidden_dim * bytes_per_element
    per_gpu_kv_bytes = chunk_len * hidden_dim * bytes_per_element * 2
    full_kv_bytes = total_seq_len * hidden_dim * bytes_per_element * 2
    ring_steps = num_gpus
    per_step_comm_bytes = per_gpu_kv_bytes
    total_comm_bytes = per_step_comm_bytes * (ring_steps - 1)
    memory_per_gpu = per_gpu_q_bytes + per_gpu_kv_bytes
    no_parallel_memory = total_seq_len * hidden_dim * bytes_per_element * 3
    memory_savings = 1 - (memory_per_gpu / no_parallel_memory)
    return {
        "chunk_length": chunk_len, "ring_steps": ring_steps, "memory_per_gpu_bytes": memory_per_gpu,
        "memory_per_gpu_mb": round(memory_per_gpu / (1024**2), 2), "full_kv_memory_bytes": full_kv_bytes,
        "per_step_comm_bytes": per_step_comm_bytes, "total_comm_bytes": total_comm_bytes,
        "total_comm_mb": round(total_comm_bytes / (1024**2), 2), "memory_savings_fraction": round(memory_savings, 4),
    }


CONTRACT_INPUTS = list(itertools.product([1, 5, 1000, 1024, 4097, 1_048_576], [1, 2, 3, 7, 8], [1, 64, 4096],
                                         [1, 8, 32], [1, 2, 4]))
# inputs the contract's code accepts although they make little sense: it returns its dict, so must we
ODD_INPUTS = [(-8, 2, 64, 8, 2), (10.0, 4, 64, 8, 2), (True, 1, 2, 3, 2), (8, -2, 64, 8, 2), (3, 8, 64, 8)]


@pytest.mark.parametrize("args", CONTRACT_INPUTS[::7] + ODD_INPUTS)
def test_equals_the_contracts_code(args):
    """Every input the contract's code accepts gives its dict, to the type (uneven lengths floor, as it does)."""
    want, got = _contract(*args), ring_attention_context_parallel(*args)
    assert got == want and [type(v) for v in got.values()] == [type(v) for v in want.values()]


@pytest.mark.parametrize("args,match", [
    ((8, 0, 64, 8), "num_gpus"), ((0, 1, 64, 8), "non-zero"), ((8, 2, 0, 8), "non-zero"),
    ((8, 2, 4, 1, 0), "non-zero"), (("8", 2, 4, 1), "total_seq_len"), ((8, 2, 4, None), "num_heads"),
])
def test_inputs_the_contract_cannot_take_are_clear_errors(args, match):
    """Where the contract's code divides by zero or fails on a type, a ValueError says why."""
    with pytest.raises(ValueError, match=match):
        ring_attention_context_parallel(*args)


def test_predicted_bytes_match_the_cost_report_for_a_full_ring():
    plan = make_plan(1024, 4)
    report = ring_attention_context_parallel(1024, 4, 64, 8, 4)["total_comm_bytes"]
    assert predicted_bytes_sent(plan, kv_width=2 * 64, itemsize=4) == [report] * 4
    # grouped-query: only the smaller K/V travels
    assert predicted_bytes_sent(plan, kv_width=2 * 16, itemsize=4) == [report // 4] * 4
