"""score_mod and learnable bias tables against oracles nobody here wrote: flex_attention (forward, eager on the CPU),
torch autograd of the definitions (backward: flex has no CPU backward), transformers' T5 buckets; one rank
(COMM_SELF) and the float64 reference. The distributed sweep is tests/test_score_mod_mpi.py."""

import math

import numpy as np
import pytest
from flex_cases import flex

import mpiring
import mpiring.testing
from mpiring import masks

torch = pytest.importorskip("torch")
MPI = pytest.importorskip("mpi4py.MPI")

B, H, HK, S, D = 2, 4, 2, 40, 8
CAUSAL = np.tril(np.ones((S, S), bool))


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((B, H, S, D)), rng.standard_normal((B, HK, S, D)), rng.standard_normal((B, HK, S, D)),
            rng.standard_normal((B, H, S, D)), rng.standard_normal((H, 32)))


def _cdf(s):
    return 0.5 * (1.0 + np.array([math.erf(x / math.sqrt(2.0)) for x in s.reshape(-1)]).reshape(s.shape))


# each modifier three ways: NumPy with its derivative (mpiring), torch ops (flex_attention and autograd)
MODS = {
    "log(gelu(s) + 1)": (lambda s, b, h, qi, ki: np.log(s * _cdf(s) + 1.0),
                         lambda s, b, h, qi, ki: (_cdf(s) + s * np.exp(-s * s / 2) / math.sqrt(2 * math.pi))
                         / (s * _cdf(s) + 1.0),
                         lambda s, b, h, qi, ki: torch.log(torch.nn.functional.gelu(s) + 1.0)),
    "checkerboard s * 0.5": (lambda s, b, h, qi, ki: np.where((qi + ki) % 2 == 0, s * 0.5, s) + 0.25 * h - 0.5 * b,
                             lambda s, b, h, qi, ki: np.where((qi + ki) % 2 == 0, 0.5, 1.0) + 0 * s,
                             lambda s, b, h, qi, ki: torch.where((qi + ki) % 2 == 0, s * 0.5, s) + 0.25 * h - 0.5 * b),
}


def _ring(q, k, v, dout, **opts):
    out, lse = mpiring.ring_attention(q, k, v, MPI.COMM_SELF, **opts)
    return out, lse, mpiring.ring_attention_backward(dout, q, k, v, out, lse, MPI.COMM_SELF, **opts)


def _autograd(q, k, v, dout, tmod, allowed, bias=None):
    """out and (dq, dk, dv[, d bias]) of the dense definition in torch float64, by autograd."""
    t = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    kk, vv = (x.repeat_interleave(H // HK, dim=1) for x in t[1:])
    s = t[0] @ kk.transpose(-1, -2) / math.sqrt(D)
    if bias is not None:
        s = s + bias
    b, h, qi, ki = (torch.arange(n).reshape(shape) for n, shape in ((B, (B, 1, 1, 1)), (H, (1, H, 1, 1)),
                                                                    (S, (1, 1, S, 1)), (S, (1, 1, 1, S))))
    s = tmod(s, b, h, qi, ki) if tmod is not None else s
    out = torch.softmax(s.masked_fill(~torch.tensor(allowed), -math.inf), dim=-1) @ vv
    (out * torch.tensor(dout)).sum().backward()
    return out.detach().numpy(), [x.grad.numpy() for x in t]


@pytest.mark.parametrize("name", list(MODS))
def test_score_mods_match_flex_attention_and_autograd(name):
    from torch.nn.attention.flex_attention import create_block_mask
    fn, dfn, tmod = MODS[name]
    q, k, v, dout, _ = _arrays()
    block = create_block_mask(lambda b, h, qi, ki: ki <= qi, B, H, S, S, device="cpu")
    want, want_lse = flex(*(torch.tensor(a) for a in (q, k, v)), score_mod=tmod, block_mask=block, enable_gqa=True)
    out, lse, grads = _ring(q, k, v, dout, causal=True, score_mod=fn, score_mod_grad=dfn)
    np.testing.assert_allclose(out, want.numpy(), atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want_lse.numpy(), atol=1e-12, rtol=0)
    ref_out, ref = _autograd(q, k, v, dout, tmod, CAUSAL)
    np.testing.assert_allclose(out, ref_out, atol=1e-12, rtol=0)
    for got, g in zip(grads, ref):
        np.testing.assert_allclose(got, g, atol=1e-12, rtol=0)
    for got, g in zip(mpiring.testing.reference_backward(dout, q, k, v, causal=True, score_mod=fn,
                                                         score_mod_grad=dfn), ref):
        np.testing.assert_allclose(got, g, atol=1e-12, rtol=0)


def test_a_wrong_derivative_gives_wrong_gradients():
    """The backward uses the given derivative: a planted wrong one moves dq, dk as the reference says it must
    (the forward and dv stay right)."""
    fn, dfn, tmod = MODS["log(gelu(s) + 1)"]
    q, k, v, dout, _ = _arrays(1)

    def wrong(*a):
        return 1.5 * dfn(*a) - 0.25
    out, _, grads = _ring(q, k, v, dout, causal=True, score_mod=fn, score_mod_grad=wrong)
    ref_out, ref = _autograd(q, k, v, dout, tmod, CAUSAL)
    np.testing.assert_allclose(out, ref_out, atol=1e-12, rtol=0)
    np.testing.assert_allclose(grads[2], ref[2], atol=1e-12, rtol=0)  # dv does not see the derivative
    assert np.abs(grads[0] - ref[0]).max() > 1e-2 and np.abs(grads[1] - ref[1]).max() > 1e-2
    planted = mpiring.testing.reference_backward(dout, q, k, v, causal=True, score_mod=fn, score_mod_grad=wrong)
    for got, want in zip(grads, planted):
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


def test_softcap_and_alibi_as_score_mods_equal_the_built_in_ones():
    q, k, v, dout, _ = _arrays(2)
    slopes = masks.alibi_slopes(H)
    as_mods = dict(score_mod=lambda s, b, h, qi, ki: 3.0 * np.tanh(s / 3.0) + slopes[h] * (ki - qi),
                   score_mod_grad=lambda s, b, h, qi, ki: 1.0 - np.tanh(s / 3.0) ** 2)
    built_in = dict(softcap=3.0, bias=masks.alibi(H))
    for layout in ("contiguous", "zigzag"):
        got = _ring(q, k, v, dout, causal=True, layout=layout, **as_mods)
        want = _ring(q, k, v, dout, causal=True, layout=layout, **built_in)
        for a, b in zip(got[:2] + got[2], want[:2] + want[2]):
            np.testing.assert_allclose(a, b, atol=1e-13, rtol=0)


def test_a_derivative_that_broadcasts_is_taken_as_the_kernel_takes_it():
    """An additive score_mod's derivative may be the scalar 1: the reference and the ring broadcast it."""
    q, k, v, dout, _ = _arrays(3)
    slopes = masks.alibi_slopes(H)
    as_mod = dict(score_mod=lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi),
                  score_mod_grad=lambda s, b, h, qi, ki: 1.0)
    want = mpiring.testing.reference_backward(dout, q, k, v, causal=True, bias=masks.alibi(H))
    got = mpiring.testing.reference_backward(dout, q, k, v, causal=True, **as_mod)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, atol=1e-13, rtol=0)
    ring = _ring(q, k, v, dout, causal=True, layout="zigzag", **as_mod)[2]
    for a, b in zip(ring, want):
        np.testing.assert_allclose(a, b, atol=1e-13, rtol=0)


def test_t5_buckets_are_transformers_buckets():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 300)
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (16, 20)):
            want = t5.T5Attention._relative_position_bucket(rel, bidirectional, buckets, distance).numpy()
            got = masks.relative_buckets(np.zeros(1, np.int64), rel.numpy(), bidirectional, buckets, distance)
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_a_t5_table_and_its_gradient_match_autograd(layout):
    q, k, v, dout, table = _arrays(3)
    bias = masks.t5_bias(table, bidirectional=True, max_distance=24)
    window = np.tril(np.ones((S, S), bool)) & np.triu(np.ones((S, S), bool), -9)
    out, lse, grads = _ring(q, k, v, dout, causal=True, window=(9, 0), layout=layout, bias=bias)
    assert len(grads) == 4
    table_t = torch.tensor(table, requires_grad=True)
    ids = torch.tensor(masks.relative_buckets(np.arange(S)[:, None], np.arange(S)[None, :], True, 32, 24))
    ref_out, ref = _autograd(q, k, v, dout, None, window, bias=table_t[:, ids])
    np.testing.assert_allclose(out, ref_out, atol=1e-12, rtol=0)
    for got, g in zip(grads, ref + [table_t.grad.numpy()]):
        np.testing.assert_allclose(got, g, atol=1e-12, rtol=0)


def test_the_torch_adapter_derives_the_derivative_and_trains_the_table():
    import mpiring.torch
    fn, _, tmod = MODS["log(gelu(s) + 1)"]
    q, k, v, dout, table = _arrays(4)
    table_t = torch.tensor(table, requires_grad=True)
    ids = torch.tensor(masks.relative_buckets(np.arange(S)[:, None], np.arange(S)[None, :], True, 32, 24))
    ref_out, ref = _autograd(q, k, v, dout, tmod, CAUSAL, bias=table_t[:, ids])
    for given in ("keyword", "spec"):  # the table as the call's keyword, or inside its spec
        param = torch.nn.Parameter(torch.tensor(table))
        t = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        bias = masks.t5_bias(param, max_distance=24)
        kw = dict(causal=True, bias=bias) if given == "keyword" else dict(spec=mpiring.Spec.of(causal=True, bias=bias))
        out = mpiring.torch.ring_attention(*t, comm=MPI.COMM_SELF, score_mod=tmod, **kw)
        (out * torch.tensor(dout)).sum().backward()
        np.testing.assert_allclose(out.detach().numpy(), ref_out, atol=1e-12, rtol=0)
        assert param.grad is not None, f"the table given as {given} got no gradient"
        for x, g in zip(t + [param], ref + [table_t.grad.numpy()]):
            np.testing.assert_allclose(x.grad.numpy(), g, atol=1e-12, rtol=0)


def test_bad_tables_and_score_mods_are_refused():
    q, k, v, dout, table = _arrays()
    with pytest.raises(ValueError, match="the bias table has 3 rows, but q has 4 query heads"):
        mpiring.ring_attention(q, k, v, MPI.COMM_SELF, bias=masks.t5_bias(table[:3]))
    with pytest.raises(ValueError, match="outside the table's 0..7"):
        mpiring.ring_attention(q, k, v, MPI.COMM_SELF, bias=masks.TableBias(table[:, :8], lambda a, b: abs(b - a)))
    with pytest.raises(ValueError, match="score_mod_grad is the derivative of a score_mod"):
        mpiring.ring_attention(q, k, v, MPI.COMM_SELF, score_mod_grad=MODS["log(gelu(s) + 1)"][1])
    with pytest.raises(ValueError, match="does not broadcast to the tile"):
        mpiring.ring_attention(q, k, v, MPI.COMM_SELF, score_mod=lambda s, b, h, qi, ki: np.zeros(3))
    with pytest.raises(ValueError, match="has no derivative"):
        mpiring.testing.reference_backward(dout, q, k, v, score_mod=MODS["log(gelu(s) + 1)"][0])


def test_the_simulator_returns_the_table_gradient():
    from mpiring.simulate import simulate_backward
    q, k, v, dout, table = _arrays(5)
    kw = dict(causal=True, bias=masks.t5_bias(table, max_distance=24), score_mod=MODS["checkerboard s * 0.5"][0],
              score_mod_grad=MODS["checkerboard s * 0.5"][1])
    out, lse, _ = mpiring.simulate(q, k, v, 3, layout="zigzag", **kw)
    grads = simulate_backward(dout, q, k, v, out, lse, 3, layout="zigzag", **kw)
    want = mpiring.testing.reference_backward(dout, q, k, v, **kw)
    assert len(grads) == 4
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="has no derivative"):
        simulate_backward(dout, q, k, v, out, lse, 3, causal=True, score_mod=MODS["checkerboard s * 0.5"][0])


def test_the_derivative_may_come_with_the_backward_alone():
    """score_mod_grad does not change the forward: an lse made without it is taken by a backward with it."""
    fn, dfn, _ = MODS["checkerboard s * 0.5"]
    q, k, v, dout, _ = _arrays(6)
    out, lse = mpiring.ring_attention(q, k, v, MPI.COMM_SELF, causal=True, score_mod=fn)
    grads = mpiring.ring_attention_backward(dout, q, k, v, out, lse, MPI.COMM_SELF, causal=True, score_mod=fn,
                                            score_mod_grad=dfn)
    for got, want in zip(grads, mpiring.testing.reference_backward(dout, q, k, v, causal=True, score_mod=fn,
                                                                   score_mod_grad=dfn)):
        np.testing.assert_allclose(got, want, atol=1e-12, rtol=0)


def test_a_backward_tile_reads_its_buckets_once_and_a_call_its_table_once():
    """The general kernel's backward evaluates a tile's TableBias bucket ids once (its bias and its table gradient
    share them), as the forward does, and reads the table once per call, not per tile."""
    from mpiring.simulate import simulate_backward
    q, k, v, dout, table = _arrays(6)
    calls = {"buckets": 0, "values": 0}

    def buckets(q_pos, k_pos):
        calls["buckets"] += 1
        return masks.relative_buckets(q_pos, k_pos, True, table.shape[1], 24)

    class Counted(masks.TableBias):
        def values(self):
            calls["values"] += 1
            return super().values()

    kw = dict(causal=True, bias=Counted(table, buckets), layout="zigzag")
    out, lse, _ = mpiring.simulate(q, k, v, 2, **kw)
    forward = dict(calls)
    calls.update(buckets=0, values=0)
    simulate_backward(dout, q, k, v, out, lse, 2, **kw)
    assert calls["values"] == forward["values"] <= 2  # the call's read, and the check's probe before it
    assert calls["buckets"] == forward["buckets"] > 0
