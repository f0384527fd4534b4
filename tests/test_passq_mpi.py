"""Pass-Q ring attention (``rotate="q"``): query blocks travel, K/V stay, partials go home.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_passq_mpi.py

Every case is checked against the dense float64 reference and against the
pass-KV ring (``rotate="kv"``) on the same inputs, for layouts, explicit
positions, masks, grouped-query heads and a prefill against a longer cache
(``kv_positions``), where ``rotate="auto"`` must choose to pass Q.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpiring import ring_attention, shard_indices
from mpiring.core.record import Record
from mpiring.parallel.passq import plan_bytes
from mpiring.testing import assert_attention_close, reference

pytestmark = pytest.mark.mpi

S = 31
CU = np.array([0, 9, 20, S])
CASES = {  # id: (ring options, mask options of the reference)
    "causal": (dict(causal=True), dict(causal=True)),
    "zigzag": (dict(causal=True, layout="zigzag"), dict(causal=True)),
    "window": (dict(window=(4, 1)), dict(window=(4, 1))),
    "documents": (dict(causal=True, cu_seqlens=CU), dict(causal=True, cu_seqlens=CU)),
    "frames": (dict(causal=True, causal_block=4, layout="striped"), dict(causal=True, causal_block=4)),
    "full": (dict(), dict()),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_pass_q_matches_pass_kv_and_the_reference(comm, case, dtype):
    options, mask = CASES[case]
    rng = np.random.default_rng(len(case))
    Q = rng.standard_normal((2, 4, S, 8)).astype(dtype)
    K, V = (rng.standard_normal((2, 2, S, 8)).astype(dtype) for _ in range(2))  # grouped-query: 2 K/V heads
    mine = shard_indices(S, comm.size, comm.rank, options.get("layout", "contiguous"))
    q, k, v = (np.ascontiguousarray(a[..., mine, :]) for a in (Q, K, V))
    ref, ref_lse = reference(q, K, V, q_positions=mine, **mask)
    results = {}
    for rotate in ("kv", "q"):
        rec = Record(comm.rank)
        results[rotate] = ring_attention(q, k, v, comm, rotate=rotate, record=rec, **options)
        assert rec.rotate == rotate
        # the busiest rank's bytes are the model's (pass-Q: query blocks, then the partials home)
        predicted = plan_bytes(rec.plan, 2 * 4, 2, 8, 8, np.dtype(dtype).itemsize)[rotate]
        assert comm.allreduce(rec.bytes_sent, op=MPI.MAX) == predicted
        assert_attention_close(results[rotate][0], ref, dtype, f"out ({rotate})")
        assert_attention_close(results[rotate][1], ref_lse, dtype, f"lse ({rotate})")
    assert_attention_close(results["q"][0], results["kv"][0], dtype, "pass-Q against pass-KV")


def test_prefill_against_a_cache_auto_passes_q(comm):
    """T new tokens after C cached (kv_positions): fewer query bytes than K/V bytes, so "auto" passes Q."""
    C, T = 200, 2 * comm.size
    rng = np.random.default_rng(11)
    Q = rng.standard_normal((8, T, 16))
    K, V = (rng.standard_normal((1, C + T, 16)) for _ in range(2))  # multi-query: one K/V head
    new = np.arange(C, C + T)
    q_pos = new[comm.rank::comm.size][::-1]  # unsorted on purpose: results come back in the caller's order
    kv_pos = rng.permutation(np.arange(comm.rank, C + T, comm.size))
    rec = Record(comm.rank)
    out, lse = ring_attention(Q[..., q_pos - C, :], K[..., kv_pos, :], V[..., kv_pos, :], comm, causal=True,
                              positions=q_pos, kv_positions=kv_pos, rotate="auto", record=rec)
    assert rec.rotate == ("q" if comm.size > 1 else "kv")  # one rank sends nothing either way
    ref, ref_lse = reference(Q[..., q_pos - C, :], K, V, causal=True, q_positions=q_pos)
    assert_attention_close(out, ref, np.float64)
    assert_attention_close(lse, ref_lse, np.float64)


@pytest.mark.parametrize("bad", ["mode", "value", "differs"])
def test_bad_rotate_raises_on_every_rank(comm, bad):
    if bad == "differs" and comm.size == 1:
        pytest.skip("needs two ranks")
    last = comm.rank == comm.size - 1
    rotate, mode = {"mode": ("q", "bidirectional" if last else "ring"), "value": ("Q" if last else "kv", "ring"),
                    "differs": ("q" if last else "kv", "ring")}[bad]
    x = np.ones((2, 3, 4))
    try:
        ring_attention(x, x, x, comm, rotate=rotate, mode=mode, timeout=30)
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert messages[0] and all(m == messages[0] for m in messages), messages
    b = comm.size - 1
    want = {"mode": f"rank {b}: rotate='q' passes the queries one way round the ring: it needs mode='ring' (also "
                    f"across ulysses_size groups), got mode='bidirectional'; that movement has no pass-Q form (not "
                    f"built)",
            "value": f"rank {b}: rotate must be one of kv, q, auto; got 'Q'",
            "differs": f"rank {b}: rotate 'q' differs from rank 0's 'kv'"}[bad]
    assert messages[0] == want


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_pass_q_takes_half_inputs(comm, dtype):
    """Half queries travel as they are and compute in float32; lse comes back in float32, as the K/V ring's;
    the backward takes the same options (rotate included) and gives the K/V ring's gradients."""
    from mpiring import ring_attention_backward
    from mpiring.core.precision import named_dtype
    from mpiring.testing import reference_backward, tolerance

    half = named_dtype(dtype)
    rng = np.random.default_rng(3)
    Q, dO = (rng.standard_normal((1, 4, S, 8)).astype(half) for _ in range(2))
    K, V = (rng.standard_normal((1, 2, S, 8)).astype(half) for _ in range(2))
    mine = shard_indices(S, comm.size, comm.rank, "zigzag")
    q, k, v, do = (np.ascontiguousarray(a[..., mine, :]) for a in (Q, K, V, dO))
    options = dict(causal=True, layout="zigzag", rotate="q")
    out, lse = ring_attention(q, k, v, comm, **options)
    assert out.dtype == half and lse.dtype == np.float32
    grads = ring_attention_backward(do, q, k, v, out, lse, comm, **options)
    wide = [a.astype(np.float64) for a in (Q, K, V, dO)]
    ref, ref_lse = reference(*wide[:3], causal=True)
    assert_attention_close(out, ref[..., mine, :], half, "out")
    assert_attention_close(lse, ref_lse[..., mine], half, "lse")
    for name, got, want in zip(("dq", "dk", "dv"), grads, reference_backward(wide[3], *wide[:3], causal=True)):
        assert got.dtype == half
        err = float(np.max(np.abs(got.astype(np.float64) - want[..., mine, :])))
        assert err <= tolerance(half) * max(1.0, float(np.max(np.abs(want)))), f"{name} {err:.3e}"


def test_the_grid_passes_queries_across_groups(comm):
    """ulysses_size with rotate='q': the ring across the groups passes the queries; the same result."""
    u = 2 if comm.size % 2 == 0 else 1
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((1, 4, S, 8)) for _ in range(3))
    mine = shard_indices(S, comm.size, comm.rank, "striped")
    q, k, v = (np.ascontiguousarray(a[..., mine, :]) for a in (Q, K, V))
    ref, ref_lse = reference(q, K, V, q_positions=mine, causal=True)
    for rotate in ("q", "kv"):
        out, lse = ring_attention(q, k, v, comm, causal=True, layout="striped", ulysses_size=u, rotate=rotate)
        assert_attention_close(out, ref, np.float64, f"out ({rotate})")
        assert_attention_close(lse, ref_lse, np.float64, f"lse ({rotate})")
