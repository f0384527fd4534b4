"""The PyTorch adapter: autograd through the ring equals PyTorch's own attention, lse's gradient included.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_torch_mpi.py
"""

import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install -e '.[torch]')")

import mpiring  # noqa: E402
import mpiring.torch  # noqa: E402

from conftest import dense_mask  # noqa: E402

pytestmark = pytest.mark.mpi


def _reference(Q, K, V, mask, scale):
    """PyTorch on the whole sequence: out and lse from their definitions, K/V heads repeated for GQA."""
    g = Q.shape[-3] // K.shape[-3]
    K, V = (t.repeat_interleave(g, dim=-3) for t in (K, V))
    s = (Q @ K.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(s, -1) @ V, torch.logsumexp(s, -1)


@pytest.mark.parametrize("use_ring", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_autograd_matches_torch(comm, use_ring, dtype):
    S, scale, layout = 26, 0.3, "zigzag"
    gen = torch.Generator().manual_seed(3)
    Q = torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64)
    K, V = (torch.randn(2, 2, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    W = torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64)  # loss = sum(W * out) + sum(G * lse)
    G = torch.randn(2, 4, S, generator=gen, dtype=torch.float64)
    mask = torch.from_numpy(dense_mask(S, causal=True, window=(5, 0)))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    out_ref, lse_ref = _reference(*leaves, mask, scale)
    ((W * out_ref).sum() + (G * lse_ref).sum()).backward()

    mine = mpiring.shard_indices(S, comm.size, comm.rank, layout)
    q, k, v = (t[..., mine, :].to(dtype).contiguous().requires_grad_() for t in (Q, K, V))
    options = dict(causal=True, window=(5, 0), layout=layout, scale=scale)
    if use_ring:
        with mpiring.Ring(comm, S, **options) as ring:
            out, lse = mpiring.torch.ring_attention(q, k, v, ring, return_lse=True)
            ((W[..., mine, :].to(dtype) * out).sum() + (G[..., mine].to(dtype) * lse).sum()).backward()
    else:
        out, lse = mpiring.torch.ring_attention(q, k, v, comm=comm, return_lse=True, **options)
        ((W[..., mine, :].to(dtype) * out).sum() + (G[..., mine].to(dtype) * lse).sum()).backward()
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    assert out.dtype == dtype and q.grad.dtype == dtype
    torch.testing.assert_close(out.double(), out_ref[..., mine, :].detach(), atol=tol, rtol=0)
    torch.testing.assert_close(lse.double(), lse_ref[..., mine].detach(), atol=tol, rtol=0)
    # dK, dV of this rank's keys: every rank's queries contributed, through the ring
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):
        torch.testing.assert_close(got.double(), leaf.grad[..., mine, :], atol=10 * tol, rtol=0)


def test_shares_memory_and_bshd(comm):
    """(B, S, H, D) tensors work through seq_axis=-3; options go to the Ring, not to each call."""
    S = 4 * comm.size
    x = torch.randn(1, S // comm.size, 2, 8, dtype=torch.float64)  # (B, S, H, D)
    with mpiring.Ring(comm, S, seq_axis=-3) as ring:
        out = mpiring.torch.ring_attention(x, x, x, ring)
    assert out.shape == x.shape
    with pytest.raises(TypeError, match="give the options to the Ring"):
        mpiring.torch.ring_attention(x, x, x, ring, causal=True)
