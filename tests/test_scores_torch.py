"""Oracles nobody here wrote: PyTorch's flex_attention (mask_mod, score_mod), SDPA with an explicit mask, and
autograd, against mpiring's masks and scores (one rank: COMM_SELF) and the float64 reference."""

import numpy as np
import pytest
from flex_cases import flex

import mpiring
from mpiring import masks
from mpiring.core.reference import scored_attention

torch = pytest.importorskip("torch")
MPI = pytest.importorskip("mpi4py.MPI")

B, H, HK, S, D = 2, 4, 2, 48, 8


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, S, D)), rng.standard_normal((B, HK, S, D)), rng.standard_normal((B, HK, S, D)),
            rng.standard_normal((B, H, S, D)), rng.standard_normal(H))


def _ring(q, k, v, dout=None, **opts):
    out, lse = mpiring.ring_attention(q, k, v, MPI.COMM_SELF, **opts)
    if dout is None:
        return out, lse
    return out, lse, mpiring.ring_attention_backward(dout, q, k, v, out, lse, MPI.COMM_SELF, **opts)


def test_flex_attention_mask_mod_and_score_mod():
    """Prefix LM | a global token, softcap and ALiBi: mpiring's forward against flex_attention's (eager, CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask
    q, k, v, _, _ = _arrays()
    slopes = torch.tensor(masks.alibi_slopes(H))

    def mask_mod(b, h, qi, ki):
        return (ki <= qi) | (ki < 6) | (ki == 20)

    def score_mod(score, b, h, qi, ki):
        return 2.5 * torch.tanh(score / 2.5) + slopes[h] * (ki - qi)

    t = [torch.tensor(a) for a in (q, k, v)]
    block = create_block_mask(mask_mod, B, H, S, S, device="cpu")
    want, want_lse = flex(t[0], t[1], t[2], score_mod=score_mod, block_mask=block, enable_gqa=True)
    mask = masks.causal() | masks.prefix(6) | masks.function(lambda a, b: b == 20)
    out, lse = _ring(q, k, v, mask=mask, softcap=2.5, bias=masks.alibi(H))
    np.testing.assert_allclose(out, want.numpy(), atol=1e-10, rtol=0)
    np.testing.assert_allclose(lse, want_lse.numpy(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("which", ["function", "padding", "frames | prefix"])
def test_sdpa_with_an_explicit_mask_forward_and_backward(which):
    q, k, v, dout, _ = _arrays(1)
    pos = np.arange(S)
    mask = {"function": masks.function(lambda a, b: (b <= a) & ((a + b) % 4 != 1)),
            "padding": masks.padding(np.array([17, 48])) & masks.causal(),
            "frames | prefix": masks.frames(8) | masks.prefix(3)}[which]
    allowed = mask.allows(pos[:, None], pos[None, :])
    allowed = allowed[:, None] if allowed.ndim == 3 else allowed
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=torch.tensor(allowed), enable_gqa=True)
    (want * torch.tensor(dout)).sum().backward()
    out, _, grads = _ring(q, k, v, dout, mask=mask)
    np.testing.assert_allclose(out, want.detach().numpy(), atol=1e-10, rtol=0)
    for got, x in zip(grads, t):
        np.testing.assert_allclose(got, x.grad.numpy(), atol=1e-10, rtol=0)


def test_autograd_of_softcap_bias_and_sinks():
    """The gradients of every modifier at once, sinks' included, against torch autograd of the definition."""
    q, k, v, dout, sinks = _arrays(2)
    pos = np.arange(S)
    bias = masks.alibi(H)
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v, sinks)]
    kk, vv = (x.repeat_interleave(H // HK, dim=1) for x in t[1:3])
    r = t[0] @ kk.transpose(-1, -2) / np.sqrt(D)
    s = 3.0 * torch.tanh(r / 3.0) + torch.tensor(bias(np.arange(H)[:, None, None], pos[None, :, None],
                                                      pos[None, None, :]))
    s = s.masked_fill(~torch.tensor(np.tril(np.ones((S, S), bool))), -torch.inf)
    full = torch.cat([s, t[3][None, :, None, None].expand(B, H, S, 1)], dim=-1)
    want = torch.softmax(full, dim=-1)[..., :S] @ vv
    (want * torch.tensor(dout)).sum().backward()
    out, lse, grads = _ring(q, k, v, dout, causal=True, softcap=3.0, bias=bias, sinks=sinks)
    np.testing.assert_allclose(out, want.detach().numpy(), atol=1e-10, rtol=0)
    np.testing.assert_allclose(lse, torch.logsumexp(full, dim=-1).detach().numpy(), atol=1e-10, rtol=0)
    for got, x in zip(grads, t):
        np.testing.assert_allclose(got, x.grad.numpy(), atol=1e-10, rtol=0)


def test_dropout_matches_the_reference_that_torch_checks():
    """Dropout: the same kept entries as the reference's definition; the reference itself against autograd."""
    q, k, v, dout, _ = _arrays(3)
    allowed = np.tril(np.ones((S, S), bool))
    want = scored_attention(q, k, v, allowed, dropout=0.25, seed=11)[0]
    out, _ = _ring(q, k, v, causal=True, dropout=0.25, seed=11)
    np.testing.assert_allclose(out, want, atol=1e-12, rtol=0)
    from mpiring.core.scores import dropout_keep
    keep = dropout_keep(11, 0.25, B, np.arange(H), np.arange(S), np.arange(S)).reshape(B, H, S, S)
    assert 0.2 < 1 - keep.mean() < 0.3, "a quarter of the entries dropped"
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    kk, vv = (x.repeat_interleave(H // HK, dim=1) for x in t[1:])
    s = (t[0] @ kk.transpose(-1, -2) / np.sqrt(D)).masked_fill(~torch.tensor(allowed), -torch.inf)
    p = torch.softmax(s, dim=-1) * torch.tensor(keep) / 0.75
    ref = p @ vv
    (ref * torch.tensor(dout)).sum().backward()
    np.testing.assert_allclose(out, ref.detach().numpy(), atol=1e-12, rtol=0)
    grads = mpiring.ring_attention_backward(dout, q, k, v, *_ring(q, k, v, causal=True, dropout=0.25, seed=11),
                                            MPI.COMM_SELF, causal=True, dropout=0.25, seed=11)
    for got, x in zip(grads, t):
        np.testing.assert_allclose(got, x.grad.numpy(), atol=1e-10, rtol=0)
