"""Memory per rank: what ring attention holds for one problem (a benchmark row), and the kernel scratch on top.

A row is any object with ``S``, ``D``, ``H``, ``B``, ``dtype``, ``backward`` (and ``wire``).
"""

import math

from ..core.precision import Precision, named_dtype
from ..core.tiles import default_tiles
from .costmodel import ring_attention_context_parallel

__all__ = ["MB", "memory_model", "kernel_scratch"]

MB = 2**20


def memory_model(cfg, P, kv_heads=None):
    """Bytes per rank that ring attention holds for benchmark row ``cfg`` on ``P`` ranks, by part.

    Local Q, K, V (the cost report's ``memory_per_gpu``), out and lse, the kept running out where it is not
    the result (float64 for float32 inputs: ``accumulate``), two K/V receive buffers in the wire's
    form (P > 1), coded blocks decoded, half inputs' q widened; forward+backward adds dout and the gradients,
    their sums where those are not the results (``Precision.sums``), the dK/dV partials' buffers and the
    kernel's gradients of one block. Kernel scratch (score tiles) is not in the model.
    """
    hk = kv_heads or cfg.H
    pr = Precision(named_dtype(cfg.dtype), getattr(cfg, "wire", None))
    e = pr.input.itemsize
    n = math.ceil(cfg.S / P)  # the longest shard
    if cfg.S % P == 0 and hk == cfg.H:
        qkv = ring_attention_context_parallel(cfg.S, P, cfg.H * cfg.D, cfg.H, e)["memory_per_gpu_bytes"] * cfg.B
    else:
        qkv = cfg.B * n * (cfg.H + 2 * hk) * cfg.D * e
    block = cfg.B * hk * n * cfg.D * e  # one of K or V
    wire_block = cfg.B * hk * n * pr.wire.row(cfg.D) * pr.wire.dtype.itemsize  # one of K or V as it travels
    parts = {"local_qkv": qkv, "out": cfg.B * cfg.H * n * cfg.D * e, "lse": cfg.B * cfg.H * n * pr.lse.itemsize,
             "kv_buffers": 4 * wire_block if P > 1 else 0}
    if pr.out != pr.input:  # the running out in its accumulating dtype, kept between calls (``tiles.filled``)
        parts["running_out"] = cfg.B * cfg.H * n * cfg.D * pr.out.itemsize
    c = pr.compute.itemsize
    if pr.wire.coded:  # the own block exactly and the block in use, decoded: [x | 1]^T of K and V each
        parts["decoded_kv"] = 4 * cfg.B * hk * n * (cfg.D + 1) * c
    if pr.input != pr.compute:  # half inputs: q widened to float32 for the tiles
        parts["widened_q"] = cfg.B * cfg.H * n * cfg.D * c
    if cfg.backward:
        # a sum's element over an input element: none apart when the sums are the results (float32 inputs)
        g = 0 if pr.sums == pr.input else pr.sums.itemsize / e
        parts["dout_grads"] = 2 * cfg.B * cfg.H * n * cfg.D * e + 2 * block  # dout, dq; dk, dv
        parts["grad_accumulators"] = int(g * (cfg.B * cfg.H * n * cfg.D * e + 2 * block))
        parts["dkv_buffers"] = int(pr.grad.itemsize / e * 6 * block) if P > 1 else 0
        # the kernel's gradients of a block's pieces, kept until added (``block.block_grads``, docs/backward.md §4)
        parts["block_grads"] = int(c / e * (cfg.B * cfg.H * n * cfg.D * e + 2 * block))
    parts["total"] = sum(parts.values())
    return parts


def kernel_scratch(cfg, plan):
    """Estimated peak scratch bytes of the tiled kernel on the busiest rank (for the out-of-memory guard)."""
    work = Precision(named_dtype(cfg.dtype)).compute  # tiles compute in float32 for half inputs
    e = work.itemsize
    n = max(len(s) for s in plan.shards)
    tiles = max(cfg.B * cfg.H * min(tq, n) * min(tk, n) * e * (4 if kind == "bwd" else 2)
                for kind in (("fwd", "bwd") if cfg.backward else ("fwd",))
                for tq, tk in [default_tiles(cfg.D, work, kind)])
    return tiles + 2 * cfg.B * cfg.H * n * (cfg.D + 1) * e + 3 * cfg.B * cfg.H * n * cfg.D * e
