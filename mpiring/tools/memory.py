"""The benchmark's memory model: what a rank holds for one row, and the kernel scratch on top of it."""

import math

import numpy as np

from mpiring.block import GRAD_DTYPE
from mpiring.costmodel import ring_attention_context_parallel
from mpiring.tiles import default_tiles

__all__ = ["MB", "memory_model", "kernel_scratch", "running_mb"]

MB = 2**20


def memory_model(cfg, P, kv_heads=None):
    """Bytes per rank the cost model says ring attention holds for benchmark row ``cfg`` on ``P`` ranks.

    The cost report's ``memory_per_gpu`` (local Q and K/V) plus the output and
    its log-sum-exp, plus the two receive buffers of a K/V block that let one
    block arrive while another is in use (only when P > 1). Forward+backward
    adds dout and the dq, dk, dv results (input dtype), their accumulators in
    the backward pass's gradient dtype (float64), and when P > 1 two receive
    buffers of a travelling dK/dV partial and one for the partial coming home.
    Kernel scratch is not in the model: it is what the 0.5x allowance and the
    "scratch" column show.
    """
    hk = kv_heads or cfg.H
    e = np.dtype(cfg.dtype).itemsize
    n = math.ceil(cfg.S / P)  # the longest shard
    if cfg.S % P == 0 and hk == cfg.H:
        qkv = ring_attention_context_parallel(cfg.S, P, cfg.H * cfg.D, cfg.H, e)["memory_per_gpu_bytes"] * cfg.B
    else:
        qkv = cfg.B * n * (cfg.H + 2 * hk) * cfg.D * e
    block = cfg.B * hk * n * cfg.D * e  # one of K or V
    parts = {"local_qkv": qkv, "out": cfg.B * cfg.H * n * cfg.D * e, "lse": cfg.B * cfg.H * n * e,
             "kv_buffers": 4 * block if P > 1 else 0}
    if cfg.backward:
        g = GRAD_DTYPE.itemsize / e  # a gradient element over an input element
        parts["dout_grads"] = 2 * cfg.B * cfg.H * n * cfg.D * e + 2 * block  # dout, dq; dk, dv
        parts["grad_accumulators"] = int(g * (cfg.B * cfg.H * n * cfg.D * e + 2 * block))
        parts["dkv_buffers"] = int(g * 6 * block) if P > 1 else 0
    parts["total"] = sum(parts.values())
    return parts


def kernel_scratch(cfg, plan):
    """Estimated peak scratch bytes of the tiled kernel on the busiest rank (for the out-of-memory guard).

    O(tile^2) scores per head plus padded copies of K/V, on the longest shard.
    """
    e = np.dtype(cfg.dtype).itemsize
    tq, tk = default_tiles(cfg.D, np.dtype(cfg.dtype))
    n = max(len(s) for s in plan.shards)
    tiles = cfg.B * cfg.H * min(tq, n) * min(tk, n) * e * (4 if cfg.backward else 2)
    return tiles + 2 * cfg.B * cfg.H * n * (cfg.D + 1) * e + 3 * cfg.B * cfg.H * n * cfg.D * e


def running_mb(row):
    """MiB of the forward pass's float64 running (out, lse) on the longest shard of a benchmark row."""
    n = math.ceil(row["S"] / row["P"])
    return row["B"] * row["H"] * n * (row["D"] + 1) * 8 / MB
