"""Seed 000's cost model, exactly, on hand-computed cases."""

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


@pytest.mark.parametrize("args,match", [
    ((1000, 3, 64, 8), "not divisible"), ((0, 1, 64, 8), "total_seq_len"), ((8, 0, 64, 8), "num_gpus"),
    ((8, 2, -1, 8), "hidden_dim"), ((8, 2, 4, 0), "num_heads"), ((8, 2, 4, 1, 0), "bytes_per_element"),
    ((8.0, 2, 4, 1), "total_seq_len"), ((8, True, 4, 1), "num_gpus"),
])
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        ring_attention_context_parallel(*args)


def test_predicted_bytes_match_seed_for_a_full_ring():
    plan = make_plan(1024, 4)
    seed = ring_attention_context_parallel(1024, 4, 64, 8, 4)["total_comm_bytes"]
    assert predicted_bytes_sent(plan, kv_width=2 * 64, itemsize=4) == [seed] * 4
    # grouped-query: only the smaller K/V travels
    assert predicted_bytes_sent(plan, kv_width=2 * 16, itemsize=4) == [seed // 4] * 4
