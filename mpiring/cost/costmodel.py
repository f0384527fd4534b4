"""Analytical cost of ring attention: memory, communication volume, steps, and time.

``ring_attention_context_parallel`` is the cost report of the problem statement, exactly. The time
model (``time_model``, ``predict_plan``) adds a FLOP rate and an alpha-beta
link: presets for an NVLink- and an InfiniBand-connected GPU, and
``mpiring.tools.calibrate`` for this machine.
"""

from dataclasses import dataclass

import numpy as np

from ..core.precision import compute_itemsize
from .by_strategy import (
    TIME_NOTES,
    TIME_VARIANTS,
    analytic,
    kv_tokens_sent,
    predicted_backward_bytes,
    predicted_bytes_sent,
)

__all__ = ["ring_attention_context_parallel", "predicted_bytes_sent", "predicted_backward_bytes", "Machine", "PRESETS",
           "TIME_VARIANTS",
           "block_flops", "time_model", "predict_plan", "format_time_model", "WIRE_BYTES", "format_wire_model",
           "time_text"]


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _positive(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _number(name, value):
    """The cost report takes what the formulas take: real numbers (as its contract's own code does)."""
    if not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")


def ring_attention_context_parallel(total_seq_len, num_gpus, hidden_dim, num_heads, bytes_per_element=2):
    """The cost report for splitting ``total_seq_len`` tokens over ``num_gpus`` devices, exactly as its contract.

    ``hidden_dim`` is the width of K (and of V) per token, all heads together.
    Returns chunk length (``total_seq_len // num_gpus``: a remainder is left
    out, as the contract's formulas do), ring steps, per-device memory of the
    local Q and K/V, full K/V memory, bytes sent per step and in total (per
    device), and the fraction of Q/K/V memory saved against one device holding
    everything. ``num_heads`` is part of the contract but enters no formula.
    Where the formulas would divide by zero, a ValueError says why.
    """
    for name, value in (("total_seq_len", total_seq_len), ("num_gpus", num_gpus), ("hidden_dim", hidden_dim),
                        ("num_heads", num_heads), ("bytes_per_element", bytes_per_element)):
        _number(name, value)
    if num_gpus == 0:
        raise ValueError("num_gpus must not be 0: the chunk length is total_seq_len // num_gpus")
    if total_seq_len * hidden_dim * bytes_per_element == 0:
        raise ValueError("total_seq_len, hidden_dim and bytes_per_element must be non-zero: the memory saved is a "
                         "fraction of total_seq_len * hidden_dim * bytes_per_element * 3")
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


@dataclass(frozen=True)
class Machine:
    """One device and its link: a FLOP rate, a latency alpha and a bandwidth beta.

    A block costs ``flop / flops`` seconds; a transfer of ``nbytes`` costs
    ``alpha + nbytes / beta``. ``beta`` is what one device can push out per
    direction; a device that sends two blocks in one step (bidirectional ring)
    shares it between them.
    """

    name: str
    flops: float  # FLOP/s the attention kernel reaches
    alpha: float  # seconds per transfer (latency)
    beta: float  # bytes per second per direction
    note: str = ""
    masked_flops: float | None = None  # FLOP/s on a masked block, counting every entry computed (None: = flops)

    def compute_time(self, flop):
        return flop / self.flops

    def transfer_time(self, nbytes):
        return self.alpha + nbytes / self.beta if nbytes else 0.0


PRESETS = {
    # H100 SXM: 989 TFLOP/s dense bf16 peak; FlashAttention-2/3 forward kernels reach 35-75% of it,
    # 400 TFLOP/s is a round effective rate. NVLink 4: 18 links x 25 GB/s = 450 GB/s per direction
    # (900 GB/s both ways); NCCL point-to-point latency within a node is a few microseconds.
    "nvlink": Machine("nvlink", 400e12, 5e-6, 450e9,
                      "H100-class GPU, 400 TFLOP/s effective bf16; NVLink 4, 450 GB/s per direction, 5 us"),
    # Same GPU, ring crosses nodes: one 400 Gb/s NDR InfiniBand NIC per GPU = 50 GB/s per direction
    # (25 GB/s with 200 Gb/s HDR; ~90% of line rate is reached); ~10 us including the software stack.
    "infiniband": Machine("infiniband", 400e12, 10e-6, 50e9,
                          "H100-class GPU, 400 TFLOP/s effective bf16; NDR InfiniBand, 50 GB/s per direction, 10 us"),
    # Same GPU, ring over commodity Ethernet: 10 Gb/s = 1.25 GB/s per direction; ~30 us through TCP.
    "10gbe": Machine("10gbe", 400e12, 30e-6, 1.25e9,
                     "H100-class GPU, 400 TFLOP/s effective bf16; 10 Gigabit Ethernet, 1.25 GB/s per direction, 30 us"),
}


def block_flops(tokens_q, tokens_k, heads, head_dim, batch=1):
    """FLOPs of attention between two full blocks: Q K^T and P V, 2 multiply-adds each."""
    return 4 * batch * heads * tokens_q * tokens_k * head_dim


def time_model(total_seq_len, num_devices, *, heads, head_dim, kv_heads=None, batch=1, bytes_per_element=2,
               machine="nvlink", variant="contiguous", causal=False, backward=False, grad_bytes_per_element=None):
    """Predicted time of one attention pass (forward or backward) over ``num_devices``.

    Every device holds ``n = total_seq_len / num_devices`` tokens. A full block
    costs ``C = 4 B H n^2 d / flops`` (backward: 2.5 C, five matmuls instead of
    two); one K/V block is ``2 B Hk n d e`` bytes (backward: K/V and their dK/dV
    partials travel together, the partials in ``grad_bytes_per_element``: 4, or
    8 when ``e`` is 8, as ``ring_attention_backward`` sends them) and moves in
    ``T = alpha + bytes / beta``. ``e`` may be fractional: an int8 wire with a
    float32 scale per token and head is ``1 + 4 / d`` bytes per element.
    Each ring step overlaps its compute with the next transfer, so it takes
    ``max(compute, transfer)``. Causal with zigzag or striped: half a block per
    step on every device; contiguous: the last device computes a full block at
    every step while others skip (same time, half the useful work); step 0 is
    the diagonal, half a block. Variants:

    - ``contiguous``/``zigzag``/``striped``: the ring, P steps, P-1 transfers;
    - ``bidirectional``: K/V go both ways; floor(P/2)+1 steps of two blocks,
      both sends share the device's bandwidth (zigzag-balanced when causal);
    - ``allgather``: one ring all-gather of P-1 blocks behind the local block,
      then P-1 blocks of compute with no communication (P times the K/V memory).

    Backward adds, after the last step, one transfer of dK/dV to their home
    device (all-gather: a ring reduce-scatter of dK/dV, P-1 transfers).
    Returns a dict of times in seconds, the per-step lists and
    ``hide_above_tokens``: the tokens per device above which the transfer
    hides behind compute (communication-bound below it).
    """
    m = PRESETS[machine] if isinstance(machine, str) else machine
    model = analytic(variant).model
    for name, value in (("total_seq_len", total_seq_len), ("num_devices", num_devices), ("heads", heads),
                        ("head_dim", head_dim), ("batch", batch)):
        _positive_int(name, value)
    _positive("bytes_per_element", bytes_per_element)
    grad_e = (8 if bytes_per_element == 8 else 4) if grad_bytes_per_element is None else grad_bytes_per_element
    _positive("grad_bytes_per_element", grad_e)
    kv_heads = heads if kv_heads is None else kv_heads
    _positive_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    P, n = num_devices, total_seq_len / num_devices
    work, traffic = (2.5, bytes_per_element + grad_e) if backward else (1.0, bytes_per_element)
    a = work * 4 * batch * heads * head_dim / m.flops  # seconds per (query, key) pair
    b = 2 * batch * kv_heads * head_dim * traffic  # bytes per token of what travels
    kv_bytes = 2 * batch * kv_heads * head_dim * bytes_per_element * n  # one K/V block
    grad_bytes = 2 * batch * kv_heads * head_dim * grad_e * n  # one dK/dV block
    full = a * n * n  # one full block
    blk_bytes = b * n
    balanced = causal and variant != "contiguous"
    later = 0.5 if balanced else 1.0  # fraction of a block the busiest device computes at step >= 1
    first = 0.5 if causal else 1.0  # step 0: the diagonal block
    compute, transfer, hops_home, hide_terms = model(P, m, first, later, full, blk_bytes, kv_bytes, b, n)
    steps = [max(c, t) for c, t in zip(compute, transfer)]
    total = sum(steps)
    if backward and P > 1:  # dK/dV go home
        total += hops_home * m.transfer_time(grad_bytes)
    useful = a * n * n * (P / 2 if causal else P)  # the device's share of the visible pairs
    # steady state: k blocks of compute against c blocks sent; solve k*f*a*n^2 = c*alpha + c*b*n/beta
    k_blocks, sends, f, per_token, latencies = hide_terms
    A, B, C = k_blocks * f * a, sends * per_token / m.beta, latencies * m.alpha
    hide = float((B + np.sqrt(B * B + 4 * A * C)) / (2 * A)) if sends and P > 1 else 0.0
    return {
        "machine": m.name, "variant": variant, "causal": bool(causal), "backward": bool(backward),
        "tokens_per_device": n, "steps": len(steps),
        "block_compute_s": full, "block_bytes": blk_bytes,
        "compute_s": compute, "transfer_s": transfer, "step_s": steps,
        "step_time_s": max(steps),  # the longest step (all-gather: step 0, with the whole gather)
        "total_s": total, "ideal_s": useful,
        "efficiency": useful / total if total else 1.0,
        "comm_bound": bool(n < hide),  # the transfer does not hide behind the steady-state compute
        "hide_above_tokens": hide,
    }


def predict_plan(plan, machine, *, batch, heads, kv_heads, head_dim, itemsize, backward=False, grad_itemsize=None):
    """Per-step prediction for a concrete plan: ``[(compute, transfer, step), ...]`` in seconds.

    Compute is the busiest rank's work at that step, counted as the score
    entries mpiring's kernel is given (``plan.pieces``), at the machine's
    ``masked_flops`` for sub-blocks with a mask; transfer is the busiest
    rank's sends started at that step (all-gather: all of them at step 0);
    backward: K/V and their dK/dV partials (``grad_itemsize``: 4, or 8 when
    ``itemsize`` is 8). Used by ``run`` to put a prediction next to the measurement.
    """
    m = machine
    grad_itemsize = compute_itemsize(itemsize) if grad_itemsize is None else grad_itemsize
    work, traffic = (2.5, itemsize + grad_itemsize) if backward else (1.0, itemsize)
    flop_per_pair = work * 4 * batch * heads * head_dim
    per_token = 2 * batch * kv_heads * head_dim * traffic
    cache = {}

    def seconds(r, j):
        if (r, j) not in cache:
            rates = [m.flops if p.klo is None else m.masked_flops or m.flops for p in plan.pieces(r, j)]
            cache[r, j] = sum((b - a) * (d - c) * flop_per_pair / rate
                              for (a, b, c, d, *_), rate in zip(plan.pieces(r, j), rates))
        return cache[r, j]

    started = [{} for _ in range(plan.size)]  # per rank: step -> tokens of each transfer it starts then
    for r, at in enumerate(started):
        for step, tokens in kv_tokens_sent(plan, r):
            at.setdefault(step, []).append(tokens)
    out = []
    for step in range(plan.n_steps):
        compute = max(sum(seconds(r, t.source) for t in plan.tasks(step, r)) for r in range(plan.size))
        transfer = max(sum((m.transfer_time(x * per_token) for x in at.get(step, ())), 0.0) for at in started)
        out.append((compute, transfer, max(compute, transfer)))
    return out


def _steady(r):
    """The step of a ``time_model`` result the tables show: the first after the diagonal, or step 0 when every
    transfer is made up front (the all-gather)."""
    return 1 if r["steps"] > 1 and not analytic(r["variant"]).up_front else 0


def time_text(seconds):
    """``seconds`` with a unit (s, ms, us, ns) and 3 significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns" if seconds else "0"


def format_time_model(total_seq_len, num_devices, *, heads, head_dim, kv_heads=None, batch=1, bytes_per_element=2,
                      machines=("nvlink", "infiniband"), causal=False, variants=TIME_VARIANTS):
    """The time model as a text table: every variant, forward and backward, for each machine."""
    kv_heads = heads if kv_heads is None else kv_heads
    n = total_seq_len / num_devices
    lines = [f"time model: {total_seq_len} tokens over P={num_devices}, {n:g} per device; {heads} query heads, "
             f"{kv_heads} K/V heads, head dim {head_dim}, {bytes_per_element} bytes/element, batch {batch}, "
             f"{'causal' if causal else 'not causal'}",
             "step = max(compute, transfer); efficiency = ideal compute time / total; "
             "'hides above' = tokens per device above which the transfer hides behind compute"]
    header = (f"{'variant':<14}{'pass':<9}{'steps':>5}  {'compute/step':>12}  {'transfer/step':>13}  "
              f"{'step':>9}  {'total':>9}  {'effic.':>6}  {'bound by':<8}  hides above")
    for machine in machines:
        m = PRESETS[machine] if isinstance(machine, str) else machine
        lines += ["", f"{m.name}: {m.note}", header]
        for variant in variants:
            for backward in (False, True):
                r = time_model(total_seq_len, num_devices, heads=heads, head_dim=head_dim, kv_heads=kv_heads,
                               batch=batch, bytes_per_element=bytes_per_element, machine=m, variant=variant,
                               causal=causal, backward=backward)
                steady = _steady(r)
                c, t = r["compute_s"][steady], r["transfer_s"][steady]
                lines.append(f"{variant:<14}{'backward' if backward else 'forward':<9}{r['steps']:>5}  "
                             f"{time_text(c):>12}  {time_text(t):>13}  {time_text(r['step_time_s']):>9}  "
                             f"{time_text(r['total_s']):>9}  {r['efficiency']:>6.0%}  "
                             f"{'transfer' if r['comm_bound'] else 'compute':<8}  "
                             f"{r['hide_above_tokens']:,.0f} tokens/device")
    lines.append("")
    lines += TIME_NOTES
    return "\n".join(lines)


# bytes per element of K/V on the wire (``wire_dtype``); int8's float32 scale per token and head adds 4 / head_dim
# (the FP8 wires move exactly int8's bytes: its row stands for them)
WIRE_BYTES = {"float32": lambda d: 4, "bfloat16": lambda d: 2, "float16": lambda d: 2, "int8": lambda d: 1 + 4 / d}


def format_wire_model(total_seq_len, num_devices, *, heads, head_dim, kv_heads=None, batch=1, causal=False,
                      machines=("nvlink", "infiniband", "10gbe"), variant=None):
    """Where each wire format wins: the forward time model per K/V wire dtype, on each machine.

    A ring step takes max(compute, transfer): a smaller wire shortens only a step
    whose transfer is exposed (fewer tokens per device than 'hides above').
    Decoding on arrival is not in the model (on a GPU it is a pass over the block).
    """
    variant = variant or ("zigzag" if causal else "contiguous")
    kv_heads = heads if kv_heads is None else kv_heads
    lines = [f"wire formats, forward, {variant}: {total_seq_len} tokens over P={num_devices}, "
             f"{total_seq_len / num_devices:g} per device; {heads} heads ({kv_heads} K/V), head dim {head_dim}, "
             f"batch {batch}{', causal' if causal else ''}",
             f"{'machine':<11}{'K/V wire':<10}{'bytes/el':>8}  {'transfer/step':>13}  {'compute/step':>12}  "
             f"{'total':>9}  {'vs bf16':>7}  {'bound by':<8}  hides above"]
    for machine in machines:
        m = PRESETS[machine] if isinstance(machine, str) else machine
        rows = {wire: time_model(total_seq_len, num_devices, heads=heads, head_dim=head_dim, kv_heads=kv_heads,
                                 batch=batch, bytes_per_element=size(head_dim), machine=m, variant=variant,
                                 causal=causal) for wire, size in WIRE_BYTES.items()}
        for wire, r in rows.items():
            steady = _steady(r)
            lines.append(f"{m.name:<11}{wire:<10}{WIRE_BYTES[wire](head_dim):>8.3g}  "
                         f"{time_text(r['transfer_s'][steady]):>13}  "
                         f"{time_text(r['compute_s'][steady]):>12}  {time_text(r['total_s']):>9}  "
                         f"{rows['bfloat16']['total_s'] / r['total_s']:>6.2f}x  "
                         f"{'transfer' if r['comm_bound'] else 'compute':<8}  {r['hide_above_tokens']:,.0f} tokens")
        fastest = min(r["total_s"] for r in rows.values())
        winners = [w for w, r in rows.items() if r["total_s"] <= fastest * 1.0001]
        if "bfloat16" in winners:
            note = f"{', '.join(winners)} hide behind compute: a smaller wire gains nothing here"
        else:
            note = f"{winners[-1]} wins, {rows['bfloat16']['total_s'] / fastest:.2f}x faster than bf16"
        lines.append(f"{'':<11}-> {note}")
    return "\n".join(lines)
