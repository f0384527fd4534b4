"""Serving shapes of decoding: interleaved cache shards, empty shards, speculative drafts, many sequences.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_serving_mpi.py

Every result is compared with the dense float64 reference over the whole
sequence (masks built here from their definitions, not from mpiring's), and
its bytes are all-gathered: every rank must hold the same bits. Inputs are
drawn whole from one seed on every rank, then sliced.
"""

import numpy as np
import pytest
from test_kvcache_mpi import _error_everywhere

from mpiring import KVCache, Record, attend_many, decode_attention, decode_many
from mpiring.core.reference import dense_attention
from mpiring.testing import assert_attention_close, reference

pytestmark = pytest.mark.mpi

H, G, D = 4, 2, 8  # query heads, K/V heads, head dim: small, the tests are about who holds what


def _qkv(seed, S, T=1, dtype=np.float64, lead=(1,)):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal(lead + (H, T, D)).astype(dtype)
    K, V = (rng.standard_normal(lead + (G, S, D)).astype(dtype) for _ in range(2))
    return Q, K, V


def _reference(q, k, v, **kw):
    """``reference``, and for no key at all the identity: out 0, lse -inf."""
    if k.shape[-2]:
        return reference(q, k, v, **kw)
    return np.zeros(q.shape[:-1] + (v.shape[-1],)), np.full(q.shape[:-1], -np.inf)


def _same_bits(comm, *arrays):
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return all(d == data for d in comm.allgather(data))


def _check(comm, got, want, dtype=np.float64, what=""):
    assert_attention_close(got[0], want[0], dtype, f"out {what}")
    assert_attention_close(got[1], want[1], dtype, f"lse {what}")
    assert _same_bits(comm, *got), f"{what}: results differ between ranks"


# ---------------------------------------------------------------- interleaved shards


@pytest.mark.parametrize("placement,n", [("interleave", 1), ("interleave", 3), ("interleave", 16),
                                         ("round_robin", 1), ("contiguous", 1)])
def test_placements_hold_every_token_once_and_attend(comm, placement, n):
    N, steps = 11, [1, 2, 1, 5, 1]
    Q, K, V = _qkv(4, N + sum(steps), T=max(steps), dtype=np.float32)
    with KVCache(comm, G, D, placement=placement, interleave=n) as cache:
        mine = cache.prompt_positions(N)
        if placement != "contiguous":  # the rule itself: token t on rank (t // n) % P
            assert np.array_equal(mine, [t for t in range(N) if (t // n) % comm.size == comm.rank])
        if all(comm.allgather(len(mine))):  # the ring needs a prompt token on every rank
            prompt_q = np.random.default_rng(5).standard_normal((1, H, N, D)).astype(np.float32)
            out, lse = cache.prefill(prompt_q[..., mine, :], K[..., mine, :], V[..., mine, :])
            want = reference(prompt_q, K[..., :N, :], V[..., :N, :], causal=True)
            assert_attention_close(out, want[0][..., mine, :], np.float32, "prefill")
        else:
            cache.extend(K[..., :N, :], V[..., :N, :])
        end = N
        for i, T in enumerate(steps):
            cache.extend(K[..., end:end + T, :], V[..., end:end + T, :])
            end += T
            q = Q[..., :T, :]
            got = cache.attend(q, exchange=("tree", "ring")[i % 2])
            _check(comm, got, reference(q, K[..., :end, :], V[..., :end, :]), np.float32, f"step {i}")
        held = comm.allgather(cache.positions)
        assert np.array_equal(np.sort(np.concatenate(held)), np.arange(end))  # every token kept once
        if placement != "contiguous":
            assert all(np.all((p // n) % comm.size == r) for r, p in enumerate(held))
        assert cache.lengths == [len(p) for p in held]
        k, v = cache.shard()
        assert np.array_equal(k, K[..., cache.positions, :]) and np.array_equal(v, V[..., cache.positions, :])
        assert cache.nbytes == 2 * G * 4 * (D + 1) * cache.lengths[comm.rank]  # K and V, float32, the row of ones


def test_interleave_needs_its_placement_and_a_positive_size(comm):
    last = comm.size - 1
    n = 0 if comm.rank == last else 2
    message = _error_everywhere(comm, lambda: KVCache(comm, G, D, placement="interleave", interleave=n))
    assert message == f"rank {last}: interleave must be a positive integer, got 0"
    message = _error_everywhere(comm, lambda: KVCache(comm, G, D, placement="contiguous", interleave=4))
    assert message.endswith("interleave=4 needs placement='interleave' (placement 'contiguous' has its own rule)")


# ---------------------------------------------------------------- empty and tiny shards


@pytest.mark.parametrize("cached", [0, 1, 2])
@pytest.mark.parametrize("merge", ["tree", "ring"])
def test_more_ranks_than_tokens_give_the_identity(comm, cached, merge):
    """Ranks with no cached token (P = 3, 4 with 0, 1, 2 tokens) contribute out 0, lse -inf; no NaN anywhere."""
    Q, K, V = _qkv(cached, cached + 1)
    with KVCache(comm, G, D, dtype=np.float64, placement="interleave", interleave=2) as cache:
        cache.extend(K[..., :cached, :], V[..., :cached, :])
        assert cache.lengths == [sum((t // 2) % comm.size == r for t in range(cached)) for r in range(comm.size)]
        got = cache.attend(Q, exchange=merge)
        assert not np.isnan(got[0]).any() and not np.isnan(got[1]).any()
        want = _reference(Q, K[..., :cached, :], V[..., :cached, :])
        if cached == 0:
            assert np.all(got[0] == 0) and np.all(np.isneginf(got[1]))
        _check(comm, got, want, what=f"{cached} cached, {merge}")


@pytest.mark.parametrize("merge", ["tree", "ring"])
def test_shards_with_no_visible_key_give_the_identity(comm, merge):
    """Causal decoding where whole shards hold only keys after the queries: those ranks give the identity."""
    S, T = 6, 2
    Q, K, V = _qkv(9, S, T)
    mine = np.arange(S)[np.arange(S) // 2 % comm.size == comm.rank]  # interleave 2
    positions = np.array([0, 1])  # the queries see positions 0 and 0..1 only: rank 0's keys
    got = decode_attention(Q, K[..., mine, :], V[..., mine, :], comm, exchange=merge, causal=True, positions=positions,
                           kv_positions=mine)
    assert not np.isnan(got[0]).any() and not np.isnan(got[1]).any()
    _check(comm, got, reference(Q, K, V, causal=True, q_positions=positions), what=merge)


# ---------------------------------------------------------------- speculative drafts


def _tree_mask(parents):
    """Draft token i sees j iff j is on the path from i up to its root (walked here, one token at a time)."""
    T = len(parents)
    mask = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j != -1:
            mask[i, j] = True
            j = parents[j]
    return mask


def _speculative_reference(q, K, V, cached, parents):
    """Float64 attention of the drafts over the first ``cached`` tokens (all seen) and the drafts after them."""
    T = len(parents)
    mask = np.concatenate([np.ones((T, cached), bool), _tree_mask(parents)], axis=1)
    keys = np.r_[0:cached, K.shape[-2] - T:K.shape[-2]]
    return dense_attention(q, K[..., keys, :], V[..., keys, :], None, lambda a, b: mask[a:b])


TREES = {"chain": [-1, 0, 1, 2], "tree": [-1, 0, 0, 1, 2, -1, 5], "one": [-1]}


@pytest.mark.parametrize("tree", TREES)
@pytest.mark.parametrize("placement,cached", [("interleave", 13), ("contiguous", 2), ("round_robin", 0)])
def test_verify_then_commit_the_accepted_path(comm, tree, placement, cached):
    parents = TREES[tree]
    T = len(parents)
    Q, K, V = _qkv([cached, T], cached + T + 3, T)
    with KVCache(comm, G, D, dtype=np.float64, placement=placement, interleave=2 if placement == "interleave" else 1) \
            as cache:
        cache.extend(K[..., :cached, :], V[..., :cached, :])
        draft_k, draft_v = K[..., cached:cached + T, :], V[..., cached:cached + T, :]
        for merge in ("tree", "ring"):
            got = cache.verify(Q, draft_k, draft_v, parents=None if tree == "chain" else parents, exchange=merge)
            want = _speculative_reference(Q, K[..., :cached + T, :], V[..., :cached + T, :], cached, parents)
            _check(comm, got, want, what=f"{tree}, {merge}")
        assert len(cache) == cached  # nothing kept before commit
        accepted = {"chain": [0, 1, 2], "tree": [0, 2, 4], "one": []}[tree]
        store = cache.store.arrays[0] if cache.store.arrays is not None else None
        cache.commit(accepted)
        assert len(cache) == cached + len(accepted)
        if store is not None and cache.store.arrays[0].shape[-1] == store.shape[-1]:
            assert cache.store.arrays[0] is store  # appended in place: the cache was not copied
        # the cache now holds the accepted drafts at the next positions: decoding goes on over them
        held = np.concatenate([K[..., :cached, :], draft_k[..., accepted, :]], axis=-2)
        held_v = np.concatenate([V[..., :cached, :], draft_v[..., accepted, :]], axis=-2)
        k, v = cache.shard()
        assert np.array_equal(k, held[..., cache.positions, :]) and np.array_equal(v, held_v[..., cache.positions, :])
        q = Q[..., :1, :]
        _check(comm, cache.attend(q), _reference(q, held, held_v), what="after commit")


def test_verify_and_commit_refuse_bad_trees_on_every_rank(comm):
    Q, K, V = _qkv(3, 8, 3)
    last = comm.size - 1
    with KVCache(comm, G, D, dtype=np.float64) as cache:
        cache.extend(K[..., :5, :], V[..., :5, :])
        parents = [-1, 0, 2] if comm.rank == last else [-1, 0, 1]
        message = _error_everywhere(comm, lambda: cache.verify(Q, K[..., 5:, :], V[..., 5:, :], parents=parents))
        assert message == (f"rank {last}: parents[2] = 2: a draft token's parent must be -1 (the cache) or an "
                           f"earlier draft token")
        message = _error_everywhere(comm, lambda: cache.commit([0]))
        assert message.endswith("commit needs a verify before it (and at most one commit per verify)")
        cache.verify(Q, K[..., 5:, :], V[..., 5:, :], parents=[-1, 0, 0])
        message = _error_everywhere(comm, lambda: cache.commit([0, 1, 2]))
        assert message.endswith("accepted [0, 1, 2] is not a path of the draft tree from a root (parents [-1, 0, 0])")
        if comm.size > 1:
            accepted = [0, 2] if comm.rank == last else [0, 1]
            message = _error_everywhere(comm, lambda: cache.commit(accepted))
            assert message.startswith(f"rank {last}: accepted [0, 2] differs from rank 0's [0, 1]")
        cache.commit([0, 2])
        assert len(cache) == 7


# ---------------------------------------------------------------- many sequences at once


LENGTHS = [0, 1, 3, 700]  # cached tokens per sequence: orders of magnitude apart, an empty one too


@pytest.mark.parametrize("merge", ["tree", "ring"])
def test_many_sequences_one_reduction(comm, merge):
    seqs = [_qkv([7, i], S, T=1 + i % 2, lead=(1 + i % 2,)) for i, S in enumerate(LENGTHS)]
    # decode_many: every rank's shards of each sequence (interleave 4)
    shards = [np.flatnonzero(np.arange(S) // 4 % comm.size == comm.rank) for S in LENGTHS]
    rec = Record(comm.rank)
    got = decode_many([q for q, _, _ in seqs], [k[..., m, :] for (_, k, _), m in zip(seqs, shards)],
                      [v[..., m, :] for (_, _, v), m in zip(seqs, shards)], comm, exchange=merge, record=rec)
    rows = sum(q.size // D for q, _, _ in seqs)  # every sequence's rows in one message per transfer
    steps = {"tree": int(np.ceil(np.log2(comm.size))), "ring": comm.size - 1}[merge]
    assert rec.messages == steps and rec.bytes_sent == steps * rows * (D + 1) * 8
    for i, ((q, k, v), g) in enumerate(zip(seqs, got)):
        _check(comm, g, _reference(q, k, v), what=f"sequence {i} ({LENGTHS[i]} cached)")
    # attend_many: a KVCache per sequence, different placements
    caches = [KVCache(comm, G, D, dtype=np.float64, placement=p, interleave=n)
              for p, n in [("interleave", 4), ("round_robin", 1), ("contiguous", 1), ("interleave", 64)]]
    rec = Record(comm.rank)
    for cache, (_, k, v) in zip(caches, seqs):
        cache.extend(k, v)
    got = attend_many(caches, [q for q, _, _ in seqs], exchange=merge, record=rec)
    assert rec.messages == steps
    for i, ((q, k, v), g) in enumerate(zip(seqs, got)):
        _check(comm, g, _reference(q, k, v), what=f"cache of sequence {i}")
    for cache in caches:
        cache.close()


def test_many_sequences_refuse_a_bad_one_on_every_rank(comm):
    seqs = [_qkv(i, 5) for i in range(3)]
    qs = [q for q, _, _ in seqs]
    ks = [k for _, k, _ in seqs]
    vs = [v for _, _, v in seqs]
    last = comm.size - 1
    if comm.rank == last:
        ks[1] = ks[1][:, :1]
        vs[1] = vs[1][:, :1]
        ks[1] = np.repeat(ks[1], 3, axis=1)
        vs[1] = np.repeat(vs[1], 3, axis=1)
    message = _error_everywhere(comm, lambda: decode_many(qs, ks, vs, comm))
    assert message == f"rank {last}: sequence 1: q heads (4) must be a multiple of k/v heads (3)"


# ---------------------------------------------------------------- prefill under one layout, decode under another


@pytest.mark.parametrize("layout,placement,n", [("zigzag", "interleave", 4), ("striped", "contiguous", 1),
                                                ("contiguous", "round_robin", 1), ("Ring", "interleave", 3)])
def test_prefill_layout_then_decode_placement(comm, layout, placement, n):
    """A prompt prefilled by ``ring_attention`` (zigzag, ...) or a ``Ring`` moves to the decode placement:
    the bytes sent are the model's (``relayout_bytes``), then decoding matches the reference."""
    from mpiring import Ring, ring_attention, shard_indices
    from mpiring.cost.infercost import relayout_bytes

    S = 8 * comm.size + 3 if layout == "striped" or layout == "Ring" else 8 * comm.size
    Q, K, V = _qkv([S, comm.size], S + 2, T=S, dtype=np.float32)
    if layout == "Ring":
        with Ring(comm, S, causal=True, layout="zigzag" if S % (2 * comm.size) == 0 else "contiguous") as ring:
            mine = ring.positions
            out, lse = ring.forward(Q[..., mine, :], K[..., mine, :], V[..., mine, :])
    else:
        mine = shard_indices(S, comm.size, comm.rank, layout)
        out, lse = ring_attention(Q[..., mine, :], K[..., mine, :], V[..., mine, :], comm, causal=True,
                                  layout=layout)
    want = reference(Q, K[..., :S, :], V[..., :S, :], causal=True)
    assert_attention_close(out, want[0][..., mine, :], np.float32, f"prefill ({layout})")
    rec = Record(comm.rank)
    with KVCache(comm, G, D, placement=placement, interleave=n) as cache:
        cache.adopt(K[..., mine, :], V[..., mine, :], mine, record=rec)
        assert np.array_equal(cache.positions, cache.prompt_positions(S))
        held = comm.allgather(mine)
        owner_of = np.empty(S, np.int64)  # the decode placement's owners, from each rank's prompt_positions
        for r, p in enumerate(comm.allgather(cache.prompt_positions(S))):
            owner_of[p] = r
        model = relayout_bytes(held, lambda p: owner_of[p], 2 * G * D * 4)
        assert rec.bytes_sent == model[comm.rank]
        assert sum(model) <= S * 2 * G * D * 4  # no token moves twice
        cache.extend(K[..., S:S + 2, :], V[..., S:S + 2, :])
        q = Q[..., :2, :]
        _check(comm, cache.attend(q, causal=True), reference(q, K, V, causal=True, q_positions=[S, S + 1]),
               np.float32, f"decode after {layout} -> {placement}")


def test_adopt_refuses_positions_that_are_not_the_prompt(comm):
    """Three prompt tokens: at P = 4 one rank holds none before and after (interleave 2: ranks 0 and 1 hold them)."""
    Q, K, V = _qkv(1, 3)
    mine = np.arange(comm.rank, 3, comm.size)
    with KVCache(comm, G, D, dtype=np.float64) as cache:
        wrong = mine + (comm.rank == 0)  # rank 0's positions shifted: position 0 is missing
        message = _error_everywhere(comm, lambda: cache.adopt(K[..., mine, :], V[..., mine, :], wrong))
        assert message == "adopt needs positions 0..2 held once each across the ranks"
    with KVCache(comm, G, D, dtype=np.float64, placement="interleave", interleave=2) as cache:
        cache.adopt(K[..., mine, :], V[..., mine, :], mine)
        assert cache.lengths == ([2, 1] + [0] * (comm.size - 2) if comm.size > 1 else [3])
        k, v = cache.shard()
        assert np.array_equal(k, K[..., cache.positions, :]) and np.array_equal(v, V[..., cache.positions, :])
        message = _error_everywhere(comm, lambda: cache.adopt(K[..., mine, :], V[..., mine, :], mine))
        assert message.endswith("adopt needs an empty cache; it holds 3 tokens")
