"""Analytical cost of ring attention: memory, communication volume, steps."""

import numpy as np

__all__ = ["ring_attention_context_parallel", "predicted_bytes_sent"]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def ring_attention_context_parallel(total_seq_len, num_gpus, hidden_dim, num_heads, bytes_per_element=2):
    """Seed 000's report for splitting ``total_seq_len`` tokens over ``num_gpus`` devices.

    ``hidden_dim`` is the width of K (and of V) per token, all heads together.
    Returns chunk length, ring steps, per-device memory of the local Q and K/V,
    full K/V memory, bytes sent per step and in total (per device), and the
    fraction of Q/K/V memory saved against one device holding everything.
    """
    for name, value in (("total_seq_len", total_seq_len), ("num_gpus", num_gpus), ("hidden_dim", hidden_dim),
                        ("num_heads", num_heads), ("bytes_per_element", bytes_per_element)):
        _positive_int(name, value)
    if total_seq_len % num_gpus:
        raise ValueError(f"total_seq_len {total_seq_len} is not divisible by num_gpus {num_gpus}")
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
        "chunk_length": chunk_len,
        "ring_steps": ring_steps,
        "memory_per_gpu_bytes": memory_per_gpu,
        "memory_per_gpu_mb": round(memory_per_gpu / (1024**2), 2),
        "full_kv_memory_bytes": full_kv_bytes,
        "per_step_comm_bytes": per_step_comm_bytes,
        "total_comm_bytes": total_comm_bytes,
        "total_comm_mb": round(total_comm_bytes / (1024**2), 2),
        "memory_savings_fraction": round(memory_savings, 4),
    }


def predicted_bytes_sent(plan, kv_width, itemsize):
    """Bytes each rank sends under ``plan``; ``kv_width`` = elements of K plus V per token.

    For an even split this is seed 000's total_comm_bytes (times batch) when
    every ring step is needed; windows and packed documents can stop the ring
    early, and the all-gather mode moves the same bytes in one collective.
    """
    sent = []
    for rank in range(plan.size):
        if plan.mode == "allgather":
            blocks = [rank] * (plan.size - 1)
        else:
            blocks = [plan.held_source(rank, stream, step) for stream, rounds in plan.rounds.items()
                      for step in range(rounds)]
        sent.append(sum(len(plan.shards[b]) for b in blocks) * kv_width * itemsize)
    return sent
