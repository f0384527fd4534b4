"""The PyTorch adapter: autograd through the ring equals PyTorch's own attention, lse's gradient included.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_torch_mpi.py
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch adapter needs torch (pip install -e '.[torch]')")

import mpiring  # noqa: E402
import mpiring.torch  # noqa: E402
from mpiring.core.ranks import ranks_text  # noqa: E402

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_tensors_in_their_own_dtype(comm, dtype):
    """bfloat16 and float16 tensors need no upcast: out and gradients come back in their dtype, within the
    tolerance table's half-precision entry of the float64 reference (on the inputs as rounded to the dtype)."""
    from mpiring.testing import tolerance

    S, layout = 6 * comm.size + 2, "contiguous"
    gen = torch.Generator().manual_seed(5)
    Q, K, V, W = (torch.randn(1, 2, S, 8, generator=gen).to(dtype).double() for _ in range(4))
    mask = torch.from_numpy(dense_mask(S, causal=True))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V)]
    out_ref, _ = _reference(*leaves, mask, 8 ** -0.5)
    (W * out_ref).sum().backward()
    mine = mpiring.shard_indices(S, comm.size, comm.rank, layout)
    q, k, v = (t[..., mine, :].to(dtype).requires_grad_() for t in (Q, K, V))
    with mpiring.Ring(comm, S, causal=True, layout=layout) as ring:
        out = mpiring.torch.ring_attention(q, k, v, ring, scale=8 ** -0.5)
        (W[..., mine, :].to(dtype) * out).sum().backward()
    tol = tolerance("bfloat16" if dtype == torch.bfloat16 else np.float16)
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in (q, k, v))
    torch.testing.assert_close(out.double(), out_ref[..., mine, :].detach(), atol=tol, rtol=0)
    for got, leaf in zip((q.grad, k.grad, v.grad), leaves):  # gradients: relative to max(1, max |reference|)
        want = leaf.grad[..., mine, :]
        torch.testing.assert_close(got.double(), want, atol=tol * max(1.0, float(want.abs().max())), rtol=0)


def test_shares_memory_and_bshd(comm):
    """(B, S, H, D) tensors work through seq_axis=-3; options go to the Ring, not to each call."""
    S = 4 * comm.size
    x = torch.randn(1, S // comm.size, 2, 8, dtype=torch.float64)  # (B, S, H, D)
    with mpiring.Ring(comm, S, seq_axis=-3) as ring:
        out = mpiring.torch.ring_attention(x, x, x, ring)
        assert out.shape == x.shape
        with pytest.raises(ValueError, match="causal=True given to this call differs from the Ring's False"):
            mpiring.torch.ring_attention(x, x, x, ring, causal=True)


def _ranks(comm):
    return ranks_text(range(comm.size))


def test_per_call_options_equal_to_the_rings_are_accepted(comm):
    """transformers passes its scaling at every call: the Ring's own value is served, another refused."""
    S = 4 * comm.size
    x = torch.randn(1, 2, S // comm.size, 8, dtype=torch.float64, requires_grad=True)  # (B, H, S, D)
    with mpiring.Ring(comm, S, causal=True, scale=0.125) as ring:
        out = mpiring.torch.ring_attention(x, x, x, ring, scale=0.125, causal=True)
        out.sum().backward()
        with pytest.raises(ValueError) as raised:
            mpiring.torch.ring_attention(x, x, x, ring, scale=0.25)
        assert str(raised.value) == (
            f"{_ranks(comm)}: scale=0.25 given to this call differs from the Ring's 0.125: the Ring would compute "
            f"something else; build the Ring with scale=0.25 (a Ring's options are fixed)")


@pytest.mark.parametrize("use_ring", [True, False])
def test_unsupported_arguments_and_dtypes_say_what_is_supported(comm, use_ring):
    S = 4 * comm.size
    x = torch.randn(1, 2, S // comm.size, 8, dtype=torch.float32)
    ring = mpiring.Ring(comm, S) if use_ring else None
    options = {} if use_ring else {"comm": comm}
    where = ("the options of a Ring go to mpiring.Ring(...)" if use_ring
             else "without a Ring, this call takes those of mpiring.ring_attention")
    with pytest.raises(ValueError) as raised:
        mpiring.torch.ring_attention(x, x, x, ring, attn_mask=torch.ones(S, S, dtype=torch.bool), **options)
    assert str(raised.value) == (
        f"{_ranks(comm)}: attn_mask is not an option of mpiring (a dense mask tensor is not taken; mpiring's masks "
        f"are rules of positions: causal=True, window=(left, right), cu_seqlens= (packed documents), "
        f"causal_block= (frames), and mask= (mpiring.masks: prefix, padding, function(fn), combined with & and |)); "
        f"{where}")
    with pytest.raises(ValueError, match="dropout_p is not an option of mpiring .mpiring's name is dropout"):
        mpiring.torch.ring_attention(x, x, x, ring, dropout_p=0.1, **options)
    b = x.to(torch.int32)
    with pytest.raises(ValueError) as raised:
        mpiring.torch.ring_attention(b, b, b, ring, **options)
    assert str(raised.value) == (
        f"{_ranks(comm)}: q is torch.int32: mpiring.torch takes bfloat16, float16, float32 and float64 CPU "
        f"tensors; convert it with .float() or .double()")
    out = mpiring.torch.ring_attention(x, x, x, ring, **options)  # nothing was left behind: the next call works
    assert out.shape == x.shape
    if ring is not None:
        ring.close()


def test_a_spec_serves_the_adapter_as_its_keywords(comm):
    """``spec=`` through autograd: the same bits, forward and backward, as the keywords it holds."""
    S = 8 * comm.size
    gen = torch.Generator().manual_seed(0)
    Q, K, V = (torch.randn(1, 4, S, 8, dtype=torch.float64, generator=gen) for _ in range(3))
    rows = torch.as_tensor(mpiring.shard_indices(S, comm.size, comm.rank, "zigzag"))

    def run(**options):
        q, k, v = (x[..., rows, :].clone().requires_grad_() for x in (Q, K, V))
        out = mpiring.torch.ring_attention(q, k, v, comm=comm, **options)
        out.sum().backward()
        return out.detach(), q.grad, k.grad, v.grad

    keywords = dict(causal=True, layout="zigzag", window=(5, 0))
    for got, want in zip(run(spec=mpiring.Spec.of(**keywords)), run(**keywords)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("seq_axis", [-2, -3])
def test_trainable_sinks_and_scores_through_autograd(comm, seq_axis):
    """gpt-oss's trainable sinks (a tensor whose gradient autograd returns), a mask with holes and softcap, in
    (B, H, S, D) and (B, S, H, D): against torch autograd of the definition; the max logit comes along."""
    from mpiring import masks
    S, layout = 22, "zigzag"
    gen = torch.Generator().manual_seed(5)
    Q = torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64)
    K, V = (torch.randn(2, 2, S, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    W = torch.randn(2, 4, S, 8, generator=gen, dtype=torch.float64)
    sinks = torch.randn(4, generator=gen, dtype=torch.float64)
    mask = masks.causal() | masks.prefix(5)
    pos = np.arange(S)
    allowed = torch.from_numpy(mask.allows(pos[:, None], pos[None, :]))
    leaves = [t.clone().requires_grad_() for t in (Q, K, V, sinks)]
    kk, vv = (t.repeat_interleave(2, dim=-3) for t in leaves[1:3])
    r = leaves[0] @ kk.transpose(-1, -2) / np.sqrt(8)
    s = (2.0 * torch.tanh(r / 2.0)).masked_fill(~allowed, float("-inf"))
    full = torch.cat([s, leaves[3][None, :, None, None].expand(2, 4, S, 1)], dim=-1)
    out_ref = torch.softmax(full, -1)[..., :S] @ vv
    (W * out_ref).sum().backward()
    top_ref = r.masked_fill(~allowed, float("-inf")).amax(dim=(-2, -1))

    mine = mpiring.shard_indices(S, comm.size, comm.rank, layout)
    q, k, v = (t[..., mine, :].contiguous() for t in (Q, K, V))
    if seq_axis == -3:
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    sink = sinks.clone().requires_grad_()
    with mpiring.Ring(comm, S, layout=layout, mask=mask, softcap=2.0, seq_axis=seq_axis,
                      return_max_logit=True) as ring:
        out, top = mpiring.torch.ring_attention(q, k, v, ring, sinks=sink)
        w = W[..., mine, :] if seq_axis == -2 else W[..., mine, :].transpose(1, 2)
        (w * out).sum().backward()
    back = (lambda t: t) if seq_axis == -2 else (lambda t: t.transpose(1, 2))
    torch.testing.assert_close(back(out).detach(), out_ref[..., mine, :].detach(), atol=1e-12, rtol=0)
    torch.testing.assert_close(top, top_ref.detach(), atol=1e-12, rtol=0)
    for got, leaf in zip((back(q.grad), back(k.grad), back(v.grad)), leaves):
        torch.testing.assert_close(got, leaf.grad[..., mine, :], atol=1e-11, rtol=0)
    # every rank's share of d loss / d sinks, summed, is the whole sequence's
    total = torch.from_numpy(np.asarray(comm.allreduce(sink.grad.numpy())))
    torch.testing.assert_close(total, leaves[3].grad, atol=1e-11, rtol=0)
    with pytest.raises(ValueError, match="sinks has 3 logits, but q has 4 query heads"):
        mpiring.torch.ring_attention(q, k, v, comm=comm, sinks=torch.zeros(3), layout=layout, seq_axis=seq_axis)
