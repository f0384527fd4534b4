"""Masks per batch entry and head, and cross-attention, as flex_attention states them: each case is one rule
written once over an array module (NumPy for mpiring, torch for flex), so both evaluate the same definition.

``expected`` gives flex_attention's forward (its block mask from ``create_block_mask`` with the same
``mask_mod``) and torch autograd's backward of the dense masked softmax, in float64. Every case lets each query
see at least one key (autograd of a row that sees nothing is NaN).
"""

import warnings

import numpy as np

B, H, HK, D = 2, 4, 2, 8
TILE = 3


def _tiles(seed, sq, sk):
    """A top-k tile map that differs per head (video-sparse attention): which key tiles each query tile sees."""
    rng = np.random.default_rng(seed)
    return rng.random((H, -(-sq // TILE), -(-sk // TILE))) < 0.4


def rules(sq, sk):
    """name -> (rule(xp) -> fn(b, h, q, k), extra spec options): ``xp`` turns NumPy tables into its arrays."""
    tiles, lengths = _tiles(sq * 31 + sk, sq, sk), np.array([max(1, sk - 3), sk])

    def tile_map(xp):
        table = xp(tiles)
        return lambda b, h, q, k: table[h, q // TILE, k // TILE] | (k == 0)

    def batch_and_head(xp):
        length = xp(lengths)
        return lambda b, h, q, k: (((q - k <= 1 + 2 * h) & (k - q <= h)) & (k < length[b])) | (k == b)

    return {"per-head tiles, causal": (tile_map, dict(causal=True)),
            "per batch and head": (batch_and_head, {})}


def numpy_fn(rule):
    return rule(np.asarray)


def flex(q, k, v, **options):
    """``(out, lse)`` of torch's flex_attention, eager on the CPU (without torch.compile: slow but exact; its
    warning about that is silenced), the lse asked for as torch 2.10+ wants it."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        out, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **options)
    return out, aux.lse


def expected(rule, causal, Q, K, V, dO):
    """``(out, lse, dq, dk, dv)`` in float64: flex_attention forward, autograd of the dense definition backward."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, do = (torch.from_numpy(np.asarray(a, np.float64)) for a in (Q, K, V, dO))
    fn = rule(torch.from_numpy)

    def mask_mod(b, h, qi, ki):
        return fn(b, h, qi, ki) & (ki <= qi) if causal else fn(b, h, qi, ki)

    sq, sk = q.shape[-2], k.shape[-2]
    block = create_block_mask(mask_mod, q.shape[0], q.shape[1], sq, sk, device="cpu")
    out, lse = flex(q, k, v, block_mask=block, enable_gqa=True)
    allowed = mask_mod(torch.arange(q.shape[0])[:, None, None, None], torch.arange(q.shape[1])[None, :, None, None],
                       torch.arange(sq)[None, None, :, None], torch.arange(sk)[None, None, None, :])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, dim=1) for t in leaves[1:])
    s = (leaves[0] @ kk.transpose(-1, -2)) / np.sqrt(q.shape[-1])
    dense = torch.softmax(s.masked_fill(~allowed, -torch.inf), dim=-1) @ vv
    (dense * do).sum().backward()
    assert torch.allclose(dense, out, atol=1e-13, rtol=0), "flex_attention and the dense definition differ"
    return (out.numpy(), lse.numpy(), *(t.grad.numpy() for t in leaves))


def arrays(sq, sk, seed=0):
    rng = np.random.default_rng(seed)
    q, do = rng.standard_normal((B, H, sq, D)), rng.standard_normal((B, H, sq, D))
    k, v = rng.standard_normal((B, HK, sk, D)), rng.standard_normal((B, HK, sk, D))
    return q, k, v, do
