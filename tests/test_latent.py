"""Multi-head latent attention's pieces (``mpiring.core.mla``) and its float64 reference, in one process.

    python -m pytest -q tests/test_latent.py

The expansion against the formulas per head; the absorbed decoding form gives
the per-head scores and outputs; a block's gradients folded into the latent
against the chain rule written out; the reference's backward against torch
autograd of the expansion and attention; a cache with shared values keeps the
latent once and serves its values as a view.
"""

import numpy as np
import pytest

from mpiring.core import mla
from mpiring.core.kvstore import KVStore
from mpiring.core.mla import Expanded, Latent, absorbed, expand, latent_keys, unabsorbed
from mpiring.testing import latent_reference, latent_reference_backward, reference

H, DN, DR, DV, R = 3, 8, 4, 6, 16


def _mla(rng, S, batch=()):
    q = rng.standard_normal(batch + (H, S, DN + DR))
    c, kr = rng.standard_normal(batch + (1, S, R)), rng.standard_normal(batch + (1, S, DR))
    return q, c, kr, rng.standard_normal((H, R, DN)) / 4, rng.standard_normal((H, R, DV)) / 4


def test_expand_is_the_up_projection_per_head(rng):
    q, c, kr, wk, wv = _mla(rng, 5, (2,))
    k, v = expand(c, kr, wk, wv)
    for b in range(2):
        for h in range(H):
            for t in range(5):
                np.testing.assert_allclose(k[b, h, t], np.concatenate([c[b, 0, t] @ wk[h], kr[b, 0, t]]), rtol=1e-13)
                np.testing.assert_allclose(v[b, h, t], c[b, 0, t] @ wv[h], rtol=1e-13)


def test_the_absorbed_form_is_the_per_head_attention(rng):
    """[q_rope | q_nope W_UK^T] against [k_rope | c] with values c, then W_UV: the per-head result."""
    S, T = 13, 3
    q, c, kr, wk, wv = _mla(rng, S)
    q = q[:, :T]
    k, v = expand(c, kr, wk, wv)
    scale = (DN + DR) ** -0.5
    keys = latent_keys(c, kr)
    np.testing.assert_allclose(absorbed(q, wk) @ np.swapaxes(keys, -1, -2), q @ np.swapaxes(k, -1, -2), rtol=1e-12)
    out, lse = reference(absorbed(q, wk), keys, keys[..., DR:], scale=scale)
    want, want_lse = reference(q, k, v, scale=scale)
    np.testing.assert_allclose(unabsorbed(out, wv), want, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, atol=1e-12)


def test_fold_is_the_chain_rule_and_sums_the_weight_gradients(rng):
    _, c, kr, wk, wv = _mla(rng, 9, (2,))
    lat = Latent(wk, wv, np.float64)
    block = lat.expanded((c, kr))
    assert isinstance(block, Expanded) and block[0].shape == (2, H, 9, DN + DR)
    dk, dv = rng.standard_normal((2, H, 4, DN + DR)), rng.standard_normal((2, H, 4, DV))
    (k0, k1, dc, dkr), = block.fold([(3, 7, dk, dv)])
    assert (k0, k1) == (3, 7)
    for b in range(2):
        for t in range(4):
            want = sum(dk[b, h, t, :DN] @ wk[h].T + dv[b, h, t] @ wv[h].T for h in range(H))
            np.testing.assert_allclose(dc[b, 0, t], want, rtol=1e-12)
            np.testing.assert_allclose(dkr[b, 0, t], dk[b, :, t, DN:].sum(axis=0), rtol=1e-12)
    for h in range(H):
        want_uk = sum(np.outer(c[b, 0, 3 + t], dk[b, h, t, :DN]) for b in range(2) for t in range(4))
        np.testing.assert_allclose(lat.weight_grads[0][h], want_uk, rtol=1e-12)
        want_uv = sum(np.outer(c[b, 0, 3 + t], dv[b, h, t]) for b in range(2) for t in range(4))
        np.testing.assert_allclose(lat.weight_grads[1][h], want_uv, rtol=1e-12)


def test_the_padded_expansion_is_the_kernels_form(rng):
    _, c, kr, wk, wv = _mla(rng, 6)
    plain, padded = Latent(wk, wv, np.float64).expanded((c, kr)), Latent(wk, wv, np.float64).expanded((c, kr), True)
    for x, p in zip(plain, padded):
        np.testing.assert_array_equal(np.swapaxes(p[..., :-1, :], -1, -2), x)
        np.testing.assert_array_equal(p[..., -1, :], 1)


def test_the_reference_backward_is_autograds(rng):
    torch = pytest.importorskip("torch")
    S = 11
    arrays = _mla(rng, S, (2,))
    dout = rng.standard_normal((2, H, S, DV))
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    q, c, kr, wk, wv = leaves
    k = torch.cat([c @ wk, kr.expand(-1, H, -1, -1)], dim=-1)
    v = c @ wv
    scores = (q @ k.transpose(-1, -2)) * (DN + DR) ** -0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    (out * torch.tensor(dout)).sum().backward()
    want_out, _ = latent_reference(*arrays, causal=True)
    np.testing.assert_allclose(want_out, out.detach().numpy(), atol=1e-12)
    for got, leaf in zip(latent_reference_backward(dout, *arrays, causal=True), leaves):
        np.testing.assert_allclose(got, leaf.grad.numpy(), atol=1e-11)


@pytest.mark.parametrize("quantize", [None, "float16", "int8"])
def test_a_store_with_shared_values_keeps_the_latent_once(rng, quantize):
    _, c, kr, _, _ = _mla(rng, 10)
    keys = latent_keys(c, kr)
    shared = KVStore(1, DR + R, R, np.float64, quantize, shared=True)
    both = KVStore(1, DR + R, R, np.float64, quantize)
    for store in (shared, both):
        store.append(keys[..., :6, :], keys[..., :6, DR:], np.arange(6))
        store.append(keys[..., 6:, :], keys[..., 6:, DR:], np.arange(6, 10))
    for got, want in zip(shared.tile(2, 9), both.tile(2, 9)):
        np.testing.assert_array_equal(got, want)
    if quantize is None:  # the values are a view of the keys' rows
        assert np.shares_memory(*shared.tile(0, 10)[:2])
    per_token = {None: (DR + R + 1) * 8, "float16": (DR + R) * 2, "int8": DR + R + 4}[quantize]  # (ones, scales)
    assert shared.nbytes == 10 * per_token
    assert both.nbytes == 10 * (per_token + {None: (R + 1) * 8, "float16": R * 2, "int8": R + 4}[quantize])


def test_bytes_per_token(rng):
    """DeepSeek-V3: 576 values of the latent against 128 x 320 per-head ones."""
    assert mla.latent_bytes(512, 64, 2) == 1152
    assert mla.per_head_bytes(128, 128, 64, 128, 2) == 81920
