"""Masks and score modifiers in decoding: ``decode_attention`` and ``KVCache`` (prefill, extend, attend) against the
dense float64 reference, the same bits on every rank; what decoding does not take is refused on every rank."""

import numpy as np
import pytest

import mpiring
from mpiring import masks
from mpiring.core.reference import scored_attention

pytestmark = pytest.mark.mpi


def _comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _same_bits(comm, *arrays):
    data = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)
    return all(d == data for d in comm.allgather(data))


def _problem(S, T, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((1, 4, S, 8)), rng.standard_normal((1, 2, S, 8)), rng.standard_normal((1, 2, S, 8)),
            rng.standard_normal(4))


MASK = masks.window(10, 0) | masks.prefix(4)


@pytest.mark.parametrize("merge", ["tree", "ring"])
@pytest.mark.parametrize("S", [3, 40])  # 3: ranks with no cached token at P = 4
def test_decode_with_masks_and_scores(merge, S):
    comm = _comm()
    P, r, T = comm.Get_size(), comm.Get_rank(), 2
    Q, K, V, sinks = _problem(S + T, T)
    q, qpos, kpos = Q[..., S:, :], np.arange(S, S + T), np.arange(S)
    allowed = MASK.allows(qpos[:, None], kpos[None, :])
    opts = dict(softcap=3.0, bias=masks.alibi(4), sinks=sinks)
    want_out, want_lse, _ = scored_attention(q, K[..., :S, :], V[..., :S, :], allowed, q_pos=qpos, k_pos=kpos,
                                             **opts)
    mine = kpos[kpos % P == r]
    out, lse = mpiring.decode_attention(q, K[..., mine, :], V[..., mine, :], comm, exchange=merge, positions=qpos,
                                        kv_positions=mine, mask=MASK, **opts)
    np.testing.assert_allclose(out, want_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)
    assert _same_bits(comm, out, lse)


def test_a_kv_cache_prefilled_and_decoded_with_scores():
    comm = _comm()
    S, steps = 29, [1, 2, 1]
    Q, K, V, sinks = _problem(S + sum(steps), 1, seed=1)
    opts = dict(mask=MASK, softcap=2.5, sinks=sinks)
    with mpiring.KVCache(comm, 2, 8, dtype=np.float64, placement="interleave", interleave=2) as cache:
        mine = cache.prompt_positions(S)
        out, _ = cache.prefill(Q[..., mine, :], K[..., mine, :], V[..., mine, :], **opts)
        pos = np.arange(S)
        allowed = MASK.allows(pos[:, None], pos[None, :]) & (pos[None, :] <= pos[:, None])  # prefill is causal
        want = scored_attention(Q[..., :S, :], K[..., :S, :], V[..., :S, :], allowed, softcap=2.5, sinks=sinks)[0]
        np.testing.assert_allclose(out, want[..., mine, :], atol=1e-12, rtol=0)
        end = S
        for T in steps:
            cache.extend(K[..., end:end + T, :], V[..., end:end + T, :])
            end += T
            qpos, kpos = np.arange(end - T, end), np.arange(end)
            o, lse = cache.attend(Q[..., end - T:end, :], causal=True, **opts)
            allowed = MASK.allows(qpos[:, None], kpos[None, :]) & (kpos[None, :] <= qpos[:, None])
            want_o, want_lse, _ = scored_attention(Q[..., end - T:end, :], K[..., :end, :], V[..., :end, :], allowed,
                                                   softcap=2.5, sinks=sinks, q_pos=qpos, k_pos=kpos)
            np.testing.assert_allclose(o, want_o, atol=1e-12, rtol=0)
            np.testing.assert_allclose(lse, want_lse, atol=1e-12, rtol=0)
            assert _same_bits(comm, o, lse)


def test_what_decoding_does_not_take_is_refused_on_every_rank():
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    Q, K, V, _ = _problem(12, 1)
    mine = np.arange(12)[np.arange(12) % P == r]
    q = Q[..., 11:, :]
    with pytest.raises(ValueError, match="decode_attention takes only .* this one also sets dropout"):
        mpiring.decode_attention(q, K[..., mine, :], V[..., mine, :], comm, spec=mpiring.Spec.of(dropout=0.1))
    for given in (dict(dropout=0.1), dict(window=(4, 0))):  # as keywords too: never accepted and left unused
        name = next(iter(given))
        with pytest.raises(ValueError, match=f"decode_attention takes only .* this one also sets {name}"):
            mpiring.decode_attention(q, K[..., mine, :], V[..., mine, :], comm, **given)
    with pytest.raises(ValueError, match="needs positions .of q. and kv_positions"):
        mpiring.decode_attention(q, K[..., mine, :], V[..., mine, :], comm, mask=MASK)
    with pytest.raises(ValueError, match="sinks has 3 logits"):
        mpiring.decode_attention(q, K[..., mine, :], V[..., mine, :], comm, sinks=np.zeros(3), positions=[11],
                                 kv_positions=mine)
