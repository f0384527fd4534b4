"""The calls of tests/test_history_mpi.py: every entry point of mpiring, small, and calls that raise.

``build(P)`` makes the catalogue for P ranks: name -> ``Entry``, a call
``run(comm) -> tuple of arrays`` with its float64 checks ``refs(comm)``.
``RAISERS``: name -> a call ``(comm) -> None`` that raises on every rank and
checks that it did. Inputs are drawn whole from a seed per entry and sliced
per rank with ``mpiring.shard_indices``: every rank of every process computes
the same problem. Nothing here imports mpi4py (nor pytest): ``fork_each``
starts MPI only in each child.

    python tests/history_catalogue.py OUT NAME...         # under mpiexec -n P too: NAMEs in turn
    python tests/history_catalogue.py OUT --each NAME...  # one process: each NAME first in a fork of it

Both write each NAME's ``bits`` to OUT/NAME.RANK.pickle, each run right
after ``mpiring.release_workspace()``; with ``--each``, each as the first
mpiring call of a process (a fork made before MPI or any mpiring call).
"""

import contextlib
import importlib.util
import os
import pickle
import sys
import traceback

import numpy as np

import mpiring
from mpiring.core import block
from mpiring.testing import reference, reference_backward, tolerance

HALF = importlib.util.find_spec("ml_dtypes") is not None
TORCH = importlib.util.find_spec("torch") is not None
F16, F32, F64 = np.float16, np.float32, np.float64
BF16 = "bfloat16"


# ---------------------------------------------------------------------- inputs


def dtype_of(dtype):
    """The NumPy dtype named ``dtype`` ("bfloat16": ml_dtypes' bfloat16)."""
    if dtype == BF16:
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


def problem(seed, S, hq, hk, d, dtype, batch=1, dv=None):
    """Whole Q, K, V, dOut of a sequence of S tokens, the same on every rank; ``batch`` None: 2-D (S, d) arrays
    (one head); ``dv``: V's head dim (default d)."""
    rng = np.random.default_rng(seed)
    dv = d if dv is None else dv
    shapes = [(hq, S, d), (hk, S, d), (hk, S, dv), (hq, S, dv)]
    shapes = [s[1:] if batch is None else (batch, *s) for s in shapes]
    return [rng.standard_normal(s).astype(dtype_of(dtype)) for s in shapes]


def part(x, rows):
    return np.ascontiguousarray(x[..., rows, :])


def mine(comm, S, layout="contiguous"):
    return mpiring.shard_indices(S, comm.size, comm.rank, layout)


class Entry:
    """A call ``run(comm) -> tuple of arrays`` and its float64 checks ``refs(comm)``, one per result:
    ``(reference, tolerance, what)`` as ``mpiring.testing.attention_error`` takes them, or None (not checked)."""

    def __init__(self, name, run, refs):
        self.name, self.run, self.refs = name, run, refs


CATALOGUE = {}


def entry(name, run, refs):
    CATALOGUE[name] = Entry(name, run, refs)


# ---------------------------------------------------------------------- ring_attention (+ backward)

FORWARD_ONLY, BACKWARD_ONLY = ("accumulate", "rotate"), ("grad_wire_dtype", "dlse")
MASK = ("causal", "window", "cu_seqlens", "causal_block")


def rows_of(comm, S, layout, seed):
    """This rank's token positions: ``shard_indices`` of a layout, or for "scattered" a seeded deal of them in
    no particular order (given as ``positions=``)."""
    if layout != "scattered":
        return mine(comm, S, layout)
    return np.random.default_rng([seed, 1]).permutation(S)[comm.rank::comm.size]


def ring(name, seed, S, hq, hk, d, dtype, layout="contiguous", backward=False, seq_axis=-2, batch=1, dv=None,
         **options):
    """``ring_attention`` (and with ``backward`` its ``ring_attention_backward``) of one problem."""
    wire = options.get("wire_dtype")
    fwd = {k: v for k, v in options.items() if k not in BACKWARD_ONLY}
    bwd = {k: v for k, v in options.items() if k not in FORWARD_ONLY and k != "dlse"}
    mask = {k: v for k, v in options.items() if k in MASK}

    def moved(x):  # (..., H, S, D) as the call takes it: seq_axis=-3 is flash-attn's (B, S, H, D)
        return x if seq_axis == -2 else np.ascontiguousarray(np.moveaxis(x, -2, seq_axis))

    def run(comm):
        Q, K, V, dO = problem(seed, S, hq, hk, d, dtype, batch, dv)
        rows = rows_of(comm, S, layout, seed)
        where = dict(positions=rows) if layout == "scattered" else dict(layout=layout)
        q, k, v, do = (moved(part(x, rows)) for x in (Q, K, V, dO))
        out, lse = mpiring.ring_attention(q, k, v, comm, seq_axis=seq_axis, **where, **fwd)
        if not backward:
            return out, np.asarray(lse)
        dlse = np.linspace(-1, 1, lse.size).reshape(lse.shape).astype(lse.dtype) if "dlse" in options else None
        grads = mpiring.ring_attention_backward(do, q, k, v, out, lse, comm, seq_axis=seq_axis, dlse=dlse, **where,
                                                **bwd)
        return (out, np.asarray(lse), *grads)

    def refs(comm):
        Q, K, V, dO = problem(seed, S, hq, hk, d, dtype, batch, dv)
        rows = rows_of(comm, S, layout, seed)
        out, lse = reference(part(Q, rows), K, V, q_positions=rows, **mask)
        tol = tolerance(dtype_of(dtype), wire)
        checks = [(moved(out), tol, "out"), (lse, tol, "lse")]
        if backward and "dlse" in options:  # the reference has no lse gradient: these are compared across calls only
            checks += [None] * 3
        elif backward:
            grads = reference_backward(dO, Q, K, V, **mask)
            checks += [(moved(part(g, rows)), 10 * tol, what) for g, what in zip(grads, ("dq", "dk", "dv"))]
        return checks

    entry(name, run, refs)


def long_sizes(P):
    """Sequence lengths whose shards exceed the kernels' default tiles at P ranks: every shard of the first
    holds more than float64's 256-row query tile (and its blocks more than a 256-key tile); every K/V block
    of the second more than float32's 256-key tile (``mpiring.core.tiles.default_tiles``)."""
    return 260 * P + 3, 300 * P + 1


def build(P):
    """The catalogue for P ranks (sizes that depend on P: Ulysses heads, shards longer than a tile)."""
    CATALOGUE.clear()
    ring("f32_contiguous", 1, 19, 2, 2, 8, F32)
    ring("f64_zigzag_causal_gqa", 2, 24, 4, 2, 8, F64, "zigzag", causal=True)
    ring("f32_striped_window", 3, 23, 2, 1, 8, F32, "striped", causal=True, window=(5, 0))
    ring("f32_bidirectional_docs", 4, 25, 2, 2, 4, F32, mode="bidirectional", causal=True,
         cu_seqlens=[0, 7, 15, 25])
    ring("f64_allgather", 5, 21, 2, 2, 8, F64, "zigzag", mode="allgather", causal=True)
    ring("f16_zigzag", 6, 22, 2, 1, 8, F16, "zigzag", causal=True)
    ring("f32_int8_wire", 7, 20, 2, 2, 16, F32, causal=True, wire_dtype="int8")
    ring("f32_f16_wire_acc32", 8, 18, 2, 2, 8, F32, "striped", wire_dtype="float16", accumulate="float32")
    ring("f32_ulysses", 9, 20, 2 * P, P, 8, F32, mode="ulysses", causal=True)
    ring("f64_double_ring", 10, 23, 2, 2, 8, F64, mode="double_ring", node_size=1, causal=True)
    ring("f32_rotate_q", 11, 21, 2, 1, 8, F32, rotate="q", causal=True)
    long_q, long_k = long_sizes(P)
    ring("f64_long_tiles", 12, long_q, 1, 1, 4, F64, "zigzag", causal=True)
    ring("b_f32_zigzag_gqa", 13, 26, 4, 2, 8, F32, "zigzag", backward=True, causal=True)
    ring("b_f64_bidirectional_window", 14, 23, 2, 2, 8, F64, mode="bidirectional", backward=True,
         window=(4, 2))
    ring("b_f16_striped", 15, 21, 2, 2, 8, F16, "striped", backward=True, causal=True)
    ring("b_f32_allgather_docs", 16, 24, 2, 1, 8, F32, mode="allgather", backward=True,
         cu_seqlens=[0, 5, 17, 24])
    ring("b_f64_ulysses", 17, 19, 2 * P, P, 4, F64, mode="ulysses", backward=True, causal=True)
    ring("b_f32_double_ring", 18, 22, 2, 2, 8, F32, "zigzag", mode="double_ring", node_size=1,
         backward=True, causal=True)
    ring("b_f32_long_keys", 19, long_k, 1, 1, 4, F32, backward=True, causal=True, grad_wire_dtype="float64")
    ring("b_f64_dlse", 20, 17, 2, 2, 8, F64, backward=True, causal=True, dlse=True)
    ring("b_f32_int8_wire", 21, 20, 2, 2, 16, F32, backward=True, causal=True, wire_dtype="int8")
    ring("f32_scattered_frames", 24, 24, 2, 2, 8, F32, "scattered", causal=True, causal_block=4)
    ring("b_f32_seq_axis_threads1", 25, 21, 2, 1, 8, F32, "zigzag", backward=True, seq_axis=-3, threads=1,
         causal=True)  # threads=1: MKL's GEMMs (when installed) at P = 1 too
    ring("b_f64_scattered_docs", 26, 22, 2, 2, 8, F64, "scattered", backward=True, cu_seqlens=[0, 9, 22])
    ring("f16_accumulate_input", 27, 20, 2, 2, 8, F16, causal=True, accumulate="input")
    ring("f32_rotate_auto_threads1", 28, 23, 4, 1, 8, F32, causal=True, rotate="auto", threads=1)
    ring("b_f32_batch_dv", 29, 19, 4, 2, 8, F32, "zigzag", backward=True, batch=2, dv=5, causal=True)
    ring("b_f64_2d_one_token", 30, P + 1, 1, 1, 8, F64, "striped", backward=True, batch=None, mode="bidirectional",
         causal=True)  # (S, d) arrays; some ranks hold one token
    grid = 2 if P % 2 == 0 else 1  # ring x Ulysses: groups of 2 where P is even
    ring("b_f32_grid_zigzag", 31, 6 * P + 1, 4, 2, 8, F32, "zigzag", backward=True, ulysses_size=grid, causal=True)
    ring("f16_ulysses_int8_wire", 32, 20, 2 * P, P, 8, F16, "striped", mode="ulysses", causal=True,
         wire_dtype="int8")
    ring("b_f16_double_ring_nodes", 33, 22, 2, 2, 8, F16, "zigzag", mode="double_ring", node_size=grid,
         backward=True, causal=True)
    ring("f16_rotate_q", 34, 21, 2, 1, 8, F16, "zigzag", rotate="q", causal=True)
    if HALF:
        ring("bf16_striped", 22, 22, 2, 2, 8, BF16, "striped", causal=True)
        ring("b_bf16_zigzag", 23, 20, 2, 1, 8, BF16, "zigzag", backward=True, causal=True)
    handles()
    others()
    on_self()
    return CATALOGUE


def on_self():
    """A ring of one rank on COMM_SELF: every rank alone, between the calls over all ranks (other plans, types)."""
    S = 23

    def run(comm):
        from mpi4py import MPI

        Q, K, V, dO = problem(60, S, 2, 1, 8, F32)
        out, lse = mpiring.ring_attention(Q, K, V, MPI.COMM_SELF, causal=True, layout="zigzag")
        return (out, np.asarray(lse), *mpiring.ring_attention_backward(dO, Q, K, V, out, lse, MPI.COMM_SELF,
                                                                        causal=True, layout="zigzag"))

    def refs(comm):
        Q, K, V, dO = problem(60, S, 2, 1, 8, F32)
        out, lse = reference(Q, K, V, causal=True)
        return [(out, 1e-5, "out"), (lse, 1e-5, "lse")] + [
            (g, 1e-4, w) for g, w in zip(reference_backward(dO, Q, K, V, causal=True), ("dq", "dk", "dv"))]

    entry("b_f32_comm_self", run, refs)


# ---------------------------------------------------------------------- the Ring handle


def handles():
    S, layout, options = 22, "zigzag", dict(causal=True, window=(6, 0))

    def call(ring, seed, comm):
        Q, K, V, dO = problem(seed, S, 4, 2, 8, F32)
        q, k, v, do = (part(x, mine(comm, S, layout)) for x in (Q, K, V, dO))
        out, lse = ring.forward(q, k, v)
        return (out, np.asarray(lse), *ring.backward(do, q, k, v, out, lse))

    def fresh_handle(comm):
        with mpiring.Ring(comm, S, layout=layout, **options) as ring:
            return call(ring, 31, comm)

    def used_handle(comm):  # another problem first, and a call that raised: then the same bits
        with mpiring.Ring(comm, S, layout=layout, **options) as ring:
            call(ring, 32, comm)
            q = np.zeros((1, 4, len(mine(comm, S, layout)), 8), F32)
            with raises(ValueError):
                ring.forward(q, q[:, :2, :, :4], q[:, :2])
            return call(ring, 31, comm)

    def refs(comm):
        Q, K, V, dO = problem(31, S, 4, 2, 8, F32)
        rows = mine(comm, S, layout)
        out, lse = reference(part(Q, rows), K, V, q_positions=rows, **options)
        grads = [part(g, rows) for g in reference_backward(dO, Q, K, V, **options)]
        return [(out, 1e-5, "out"), (lse, 1e-5, "lse")] + [(g, 1e-4, w) for g, w in zip(grads, ("dq", "dk", "dv"))]

    entry("ring_handle", fresh_handle, refs)
    entry("ring_handle_used", used_handle, refs)


# ---------------------------------------------------------------------- decode, KV cache, root, simulator, torch


def others():
    S, T = 27, 3

    def decode(merge, dtype, causal, layout):
        def arrays(comm):
            Q, K, V, _ = problem(40, S, 4, 2, 8, dtype)
            return Q[..., S - T:, :], K, V, mine(comm, S, layout)

        def run(comm):
            q, K, V, rows = arrays(comm)
            extra = dict(positions=np.arange(S - T, S), kv_positions=rows) if causal else {}
            return mpiring.decode_attention(q, part(K, rows), part(V, rows), comm, exchange=merge, causal=causal,
                                            **extra)

        def refs(comm):
            q, K, V, _ = arrays(comm)
            out, lse = reference(q, K, V, causal=causal, q_positions=np.arange(S - T, S))
            return [(out, tolerance(dtype), "out"), (lse, tolerance(dtype), "lse")]

        return run, refs

    entry("decode_tree", *decode("tree", F32, False, "contiguous"))
    entry("decode_ring_causal", *decode("ring", F64, True, "striped"))

    def kvcache(quantize, dtype, placement="round_robin"):
        def run(comm):
            Q, K, V, _ = problem(41, S + T, 2, 1, 8, dtype)
            rows = mine(comm, S)
            with mpiring.KVCache(comm, 1, 8, dtype=dtype, quantize=quantize, placement=placement) as cache:
                out, lse = cache.prefill(*(part(x[..., :S, :], rows) for x in (Q, K, V)), positions=rows)
                cache.extend(K[..., S:, :], V[..., S:, :])
                return (out, np.asarray(lse), *cache.attend(Q[..., S:, :], causal=True))

        def refs(comm):
            Q, K, V, _ = problem(41, S + T, 2, 1, 8, dtype)
            rows = mine(comm, S)
            out, lse = reference(part(Q, rows), K[..., :S, :], V[..., :S, :], causal=True, q_positions=rows)
            new = reference(Q[..., S:, :], K, V, causal=True, q_positions=np.arange(S, S + T))
            tol, bound = tolerance(dtype), {None: tolerance(dtype), "float16": 1e-3, "int8": 2.5e-2}[quantize]
            return [(out, tol, "out"), (lse, tol, "lse"), (new[0], bound, "out"), (new[1], bound, "lse")]

        return run, refs

    entry("kvcache", *kvcache(None, F32))
    entry("kvcache_int8", *kvcache("int8", F64))
    entry("kvcache_f16_contiguous", *kvcache("float16", F32, "contiguous"))

    def distributed(comm):
        Q, K, V, _ = problem(42, 21, 2, 2, 8, F32)
        root = comm.rank == 0
        out, lse, _ = mpiring.distributed_attention(*(x if root else None for x in (Q, K, V)), comm, causal=True,
                                                    layout="zigzag", return_lse=True)
        return (out, lse) if root else ()

    def distributed_refs(comm):
        Q, K, V, _ = problem(42, 21, 2, 2, 8, F32)
        return [(r, 1e-5, w) for r, w in zip(reference(Q, K, V, causal=True), ("out", "lse"))] if comm.rank == 0 else []

    entry("distributed", distributed, distributed_refs)

    def distributed_backward(comm):
        Q, K, V, dO = problem(43, 23, 2, 1, 8, F64)
        root = comm.rank == 0
        *results, _ = mpiring.distributed_attention_backward(*(x if root else None for x in (Q, K, V, dO)), comm,
                                                             window=(3, 3), mode="bidirectional", return_out=True)
        return tuple(results) if root else ()

    def distributed_backward_refs(comm):
        if comm.rank != 0:
            return []
        Q, K, V, dO = problem(43, 23, 2, 1, 8, F64)
        refs = [reference(Q, K, V, window=(3, 3))[0], *reference_backward(dO, Q, K, V, window=(3, 3))]
        return [(r, 1e-11, w) for r, w in zip(refs, ("out", "dq", "dk", "dv"))]

    entry("distributed_backward", distributed_backward, distributed_backward_refs)

    def simulated(comm):  # one process: every rank runs the whole simulation
        Q, K, V, _ = problem(44, 24, 2, 1, 8, F32)
        out, lse, _ = mpiring.simulate(Q, K, V, 3, causal=True, layout="zigzag", wire_dtype="float16")
        rounded, _ = mpiring.ring_attention_simulate(Q[0, 0], K[0, 0], V[0, 0], 4)
        return out, lse, rounded

    def simulated_refs(comm):
        Q, K, V, _ = problem(44, 24, 2, 1, 8, F32)
        out, lse = reference(Q, K, V, causal=True)
        tol = tolerance(F32, "float16")
        return [(out, tol, "out"), (lse, tol, "lse"), (reference(Q[0, 0], K[0, 0], V[0, 0])[0], 1e-4, "out")]

    entry("simulate", simulated, simulated_refs)

    if TORCH:
        def torched(comm):
            import torch

            import mpiring.torch as mt

            Q, K, V, dO = problem(45, 20, 2, 2, 8, F32)
            rows = mine(comm, 20, "zigzag")
            q, k, v = (torch.from_numpy(part(x, rows)).requires_grad_() for x in (Q, K, V))
            out, lse = mt.ring_attention(q, k, v, comm=comm, causal=True, layout="zigzag", return_lse=True)
            (out * torch.from_numpy(part(dO, rows))).sum().backward()
            return tuple(t.detach().numpy() for t in (out, lse, q.grad, k.grad, v.grad))

        def torched_refs(comm):
            Q, K, V, dO = problem(45, 20, 2, 2, 8, F32)
            rows = mine(comm, 20, "zigzag")
            out, lse = reference(part(Q, rows), K, V, causal=True, q_positions=rows)
            grads = [part(g, rows) for g in reference_backward(dO, Q, K, V, causal=True)]
            return [(out, 1e-5, "out"), (lse, 1e-5, "lse")] + [(g, 1e-4, w) for g, w in zip(grads, ("dq", "dk", "dv"))]

        entry("torch", torched, torched_refs)


# ---------------------------------------------------------------------- calls that raise


@contextlib.contextmanager
def raises(kind):
    """Like ``pytest.raises(kind)``, without pytest."""
    try:
        yield
    except kind:
        return
    raise AssertionError(f"did not raise {kind.__name__}")


class Injected(RuntimeError):
    """An error raised inside the ring on purpose, after its kept buffers were written."""


def _failing(real, name, at):
    """``real`` (``block.attend`` or ``block.grads_of``), but its call number ``at`` raises ``Injected``."""
    calls = []

    def fail(*args, **kwargs):
        calls.append(None)
        if len(calls) == at:
            raise Injected(f"injected into call {at} of block.{name}")
        return real(*args, **kwargs)

    return fail


def raise_in_ring(comm, name, backward, later):
    """A call that fails inside the ring on every rank: ``block.attend`` or ``block.grads_of`` raises at its first
    call (step 0), or with ``later`` at its second (step 1: after a wait and a swap; the first again at P = 1).

    Every rank computes one block per step in this ring, so all fail at the same point.
    """
    Q, K, V, dO = problem(50, 22, 2, 2, 8, F32)
    rows = mine(comm, 22, "zigzag")
    q, k, v, do = (part(x, rows) for x in (Q, K, V, dO))
    out, lse = mpiring.ring_attention(q, k, v, comm, layout="zigzag", causal=True) if backward else (None, None)
    real = getattr(block, name)
    setattr(block, name, _failing(real, name, min(comm.size, 2) if later else 1))
    try:
        with raises(Injected):
            if backward:
                mpiring.ring_attention_backward(do, q, k, v, out, lse, comm, layout="zigzag", causal=True)
            else:
                mpiring.ring_attention(q, k, v, comm, layout="zigzag", causal=True)
    finally:
        setattr(block, name, real)


def _bad(comm):
    Q, K, V, dO = problem(51, 20, 2, 2, 8, F64)
    rows = mine(comm, 20)
    return [part(x, rows) for x in (Q, K, V, dO)]


def raise_layout(comm):
    q, k, v, _ = _bad(comm)
    with raises(ValueError):
        mpiring.ring_attention(q, k, v, comm, layout="spiral")


def raise_shapes(comm):
    q, k, v, _ = _bad(comm)
    with raises(ValueError):
        mpiring.ring_attention(q, k[..., :4], v, comm, causal=True)


def raise_backward_options(comm):  # an lse made with causal=True, given to a backward without it
    q, k, v, do = _bad(comm)
    out, lse = mpiring.ring_attention(q, k, v, comm, causal=True)
    with raises(ValueError):
        mpiring.ring_attention_backward(do, q, k, v, out, lse, comm)


def raise_decode(comm):
    q, k, v, _ = _bad(comm)
    with raises(ValueError):
        mpiring.decode_attention(q, k, v, comm, exchange="star")


def raise_kvcache(comm):
    with raises(ValueError):
        mpiring.KVCache(comm, 2, 8, quantize="int4")


def raise_distributed(comm):
    Q, K, V, _ = problem(52, 20, 2, 2, 8, F32)
    with raises(ValueError):
        mpiring.distributed_attention(*(x if comm.rank == 0 else None for x in (Q, K, V)), comm, mode="spiral")


def raise_handle(comm):
    with raises(ValueError):
        mpiring.Ring(comm, 20, window=(-3, 1))


def raise_simulate(comm):
    Q, K, V, _ = problem(53, 20, 2, 2, 8, F32)
    with raises(ValueError):
        mpiring.simulate(Q, K, V, 0)


RAISERS = {
    "raise_layout": raise_layout, "raise_shapes": raise_shapes, "raise_backward_options": raise_backward_options,
    "raise_decode": raise_decode, "raise_kvcache": raise_kvcache, "raise_distributed": raise_distributed,
    "raise_handle": raise_handle, "raise_simulate": raise_simulate,
    "raise_in_forward": lambda comm: raise_in_ring(comm, "attend", False, False),
    "raise_in_forward_later": lambda comm: raise_in_ring(comm, "attend", False, True),
    "raise_in_backward": lambda comm: raise_in_ring(comm, "grads_of", True, False),
    "raise_in_backward_later": lambda comm: raise_in_ring(comm, "grads_of", True, True),
}


# ---------------------------------------------------------------------- running


def bits(arrays):
    """What must not change: every array's dtype, shape and bytes."""
    return [(np.asarray(a).dtype.name, np.shape(a), np.ascontiguousarray(a).tobytes()) for a in arrays]


def results(name, comm):
    """Run catalogue entry or raiser ``name``: its result arrays (None for a raiser)."""
    if name in RAISERS:
        RAISERS[name](comm)
        return None
    return CATALOGUE[name].run(comm)


def call(name, comm):
    """Run catalogue entry or raiser ``name``: the bits of its results (None for a raiser)."""
    arrays = results(name, comm)
    return None if arrays is None else bits(arrays)


def run_fresh(names, comm):
    """Every entry of ``names`` in turn, each right after ``release_workspace()``: name -> bits."""
    results = {}
    for name in names:
        mpiring.release_workspace()
        results[name] = call(name, comm)
    return results


def _save(out, name, rank, result):
    with open(os.path.join(out, f"{name}.{rank}.pickle"), "wb") as f:
        pickle.dump(result, f)


def _fork(name, out):
    """A fork of this process that runs ``name`` as its first mpiring call (MPI starts in it: a singleton)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from mpi4py import MPI

            _save(out, name, 0, call(name, MPI.COMM_WORLD))
            MPI.Finalize()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # not the parent's exit handlers
    return pid


def fork_each(names, out, at_once=2):
    """Each of ``names`` as the first call of its own process, ``at_once`` at a time (P = 1).

    The processes are forks of this one, made before MPI started or mpiring was called:
    a new interpreter but for the imports.
    """
    build(1)
    running, failed = {}, []
    for name in names + [None] * at_once:
        if len(running) == at_once or (name is None and running):
            pid, status = os.wait()
            if status:
                failed.append(running[pid])
            del running[pid]
        if name is not None:
            running[_fork(name, out)] = name
    if failed:
        raise SystemExit(f"the fresh processes of {failed} failed")


if __name__ == "__main__":
    os.environ.setdefault("MPIRING_TUNE_CACHE", "off")  # as tests/conftest.py: the code's own tiles and backend
    out_dir, *run_names = sys.argv[1:]
    if run_names[:1] == ["--each"]:
        fork_each(run_names[1:], out_dir)
    else:
        from mpi4py import MPI

        build(MPI.COMM_WORLD.size)
        for run_name, result in run_fresh(run_names, MPI.COMM_WORLD).items():
            _save(out_dir, run_name, MPI.COMM_WORLD.rank, result)
