"""Decoding against a KV cache sharded over the ranks: ``decode_attention``, tree and ring merges.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_decode_mpi.py

Every result is checked against the dense float64 reference over the whole
cache, and its bytes are all-gathered: every rank must hold the same bits.
Shards are uneven, and some ranks hold none of the cache.
"""

import numpy as np
import pytest

from mpiring import decode_attention
from mpiring.core.kernels import merge
from mpiring.decode import lse_merge, packed
from mpiring.testing import assert_attention_close, reference

pytestmark = pytest.mark.mpi


def _shards(S, size, rng, empty):
    """Uneven, unsorted shards of range(S); with ``empty``, rank 0 (and rank 2 if any) hold nothing."""
    owners = rng.integers(0, size, S)
    if empty and size > 1:
        owners = np.where(np.isin(owners, [0, 2]), size - 1, owners)
    return [rng.permutation(np.flatnonzero(owners == r)) for r in range(size)]


def _same_bits(comm, *arrays):
    data = b"".join(a.tobytes() for a in arrays)
    return all(d == data for d in comm.allgather(data))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("merge_how", ["tree", "ring"])
@pytest.mark.parametrize("T,heads,kv_heads,empty", [(1, 4, 1, False), (3, 4, 2, True), (2, 2, 2, False)])
def test_decode_matches_reference(comm, dtype, merge_how, T, heads, kv_heads, empty):
    rng = np.random.default_rng([T, heads, kv_heads, int(empty)])  # the same on every rank
    S, D = 29, 8
    Q = rng.standard_normal((2, heads, T, D)).astype(dtype)
    K, V = (rng.standard_normal((2, kv_heads, S, D)).astype(dtype) for _ in range(2))
    mine = _shards(S, comm.size, rng, empty)[comm.rank]
    out, lse = decode_attention(Q, K[..., mine, :], V[..., mine, :], comm, merge=merge_how)
    ref, ref_lse = reference(Q, K, V)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_attention_close(out, ref, dtype, f"out ({merge_how})")
    assert_attention_close(lse, ref_lse, dtype, f"lse ({merge_how})")
    assert _same_bits(comm, out, lse)


@pytest.mark.parametrize("merge_how", ["tree", "ring"])
def test_decode_causal_new_tokens_in_the_cache(comm, merge_how):
    """T new tokens already appended (round-robin) to a cache: among themselves causal, the prompt fully seen."""
    rng = np.random.default_rng(7)
    S, T, D = 23, 4, 16
    Q = rng.standard_normal((3, T, D))
    K, V = (rng.standard_normal((1, S, D)) for _ in range(2))
    mine = np.arange(comm.rank, S, comm.size)
    new = np.arange(S - T, S)
    out, lse = decode_attention(Q, K[..., mine, :], V[..., mine, :], comm, merge=merge_how, causal=True,
                                positions=new, kv_positions=mine)
    ref, ref_lse = reference(Q, K, V, causal=True, q_positions=new)
    assert_attention_close(out, ref, np.float64)
    assert_attention_close(lse, ref_lse, np.float64)
    assert _same_bits(comm, out, lse)


def test_lse_merge_is_the_log_sum_exp_rule_and_commutes_to_the_bit():
    rng = np.random.default_rng(3)
    out_a, out_b = rng.standard_normal((2, 50, 8))
    lse_a, lse_b = rng.standard_normal((2, 50)) * 30
    lse_a[:5] = -np.inf  # rows one side does not see
    lse_b[3:7] = -np.inf
    out_a[:5] = 0
    out_b[3:7] = 0
    a, b = packed(out_a, lse_a), packed(out_b, lse_b)
    ab, ba = b.copy(), a.copy()
    lse_merge(a, ab)
    lse_merge(b, ba)
    assert ab.tobytes() == ba.tobytes()
    want_out, want_lse = merge(out_a, lse_a, out_b, lse_b)
    assert np.abs(ab[:, :-1] - want_out).max() < 1e-13
    assert np.allclose(ab[:, -1], want_lse, rtol=0, atol=1e-13, equal_nan=False)
    assert np.all(ab[3:5, :-1] == 0) and np.all(np.isneginf(ab[3:5, -1]))


def _bad_cases(size):
    """(name, change made on the last rank, expected start of the message; b = the last rank)."""
    cases = [
        ("heads", lambda q, k, v, kw: (q, k[:, :3], v[:, :3], kw),
         "rank {b}: q heads (4) must be a multiple of k/v heads (3)"),
        ("merge", lambda q, k, v, kw: (q, k, v, dict(kw, merge="star")),
         "rank {b}: merge must be one of tree, ring; got 'star'"),
        ("causal without positions", lambda q, k, v, kw: (q, k, v, dict(kw, causal=True)),
         "rank {b}: causal decoding needs positions: a 1-D integer array of 2 global positions"),
    ]
    if size > 1:
        cases.append(("q differs", lambda q, k, v, kw: (q + 1, k, v, kw),
                      "rank {b}: q differs from rank 0's: q (numpy.ndarray float64 (1, 4, 2, 8)): first differing "
                      "element (0, 0, 0, 0): rank 0 has "))
    return cases


@pytest.mark.parametrize("case", range(4))
def test_bad_input_raises_the_same_error_on_every_rank(comm, case):
    cases = _bad_cases(comm.size)
    if case >= len(cases):
        pytest.skip("needs two ranks")
    name, change, text = cases[case]
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 2, 8))
    k, v = (rng.standard_normal((1, 4, comm.rank + 1, 8)) for _ in range(2))
    kw = {"timeout": 30}
    if comm.rank == comm.size - 1:
        q, k, v, kw = change(q, k, v, kw)
    try:
        decode_attention(q, k, v, comm, **kw)
        message = None
    except ValueError as exc:
        message = str(exc)
    messages = comm.allgather(message)
    assert messages[0] is not None and all(m == messages[0] for m in messages), messages
    assert messages[0].startswith(text.format(b=comm.size - 1)), messages[0]
    assert comm.allreduce(1) == comm.size  # the communicator still works
