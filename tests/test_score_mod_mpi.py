"""score_mod with its derivative, and learnable bias tables (T5's relative buckets), under every strategy: forward,
backward and d table against the float64 reference (``scored_attention``, checked against flex_attention and torch
autograd in tests/test_score_mod.py), on however many ranks the test runs.

One compact sweep: each strategy meets each modifier once, the layout and the mask turning with them.
"""

import math

import numpy as np
import pytest

import mpiring
import mpiring.testing
from mpiring import masks

pytestmark = pytest.mark.mpi

B, H, HK, D, S = 2, 4, 2, 8, 29
STRATEGIES = {"ring": {}, "bidirectional": dict(mode="bidirectional"), "allgather": dict(mode="allgather"),
              "pass-q": dict(rotate="q"), "ulysses": dict(mode="ulysses"), "double_ring": dict(mode="double_ring"),
              "grid": dict(ulysses_size=2), "sparse": dict(mode="sparse")}
LAYOUTS = ("zigzag", "contiguous")
MASKS = ({"causal": True}, {"causal": True, "window": (6, 0)}, {"cu_seqlens": np.array([0, 11, 20, S])},
         {"mask": masks.causal() | masks.prefix(4)})


def _comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    q, dout = rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D))
    k, v = rng.standard_normal((B, HK, S, D)), rng.standard_normal((B, HK, S, D))
    return q, k, v, dout, rng.standard_normal((H, 16))


def _cdf(s):
    return 0.5 * (1.0 + np.array([math.erf(x / math.sqrt(2.0)) for x in s.reshape(-1)]).reshape(s.shape))


def log_gelu(s, b, h, qi, ki):
    return np.log(s * _cdf(s) + 1.0)


def log_gelu_grad(s, b, h, qi, ki):
    return (_cdf(s) + s * np.exp(-s * s / 2) / math.sqrt(2 * math.pi)) / (s * _cdf(s) + 1.0)


def checker_half(s, b, h, qi, ki):
    return np.where((qi + ki) % 2 == 0, s * 0.5, s) + 0.25 * h - 0.5 * b


def checker_half_grad(s, b, h, qi, ki):
    return np.broadcast_to(np.where((qi + ki) % 2 == 0, 0.5, 1.0), np.broadcast_shapes(s.shape, qi.shape, ki.shape))


def modifiers(table):
    return {"log(gelu(s) + 1)": dict(score_mod=log_gelu, score_mod_grad=log_gelu_grad),
            "checkerboard s * 0.5, softcap": dict(score_mod=checker_half, score_mod_grad=checker_half_grad,
                                                  softcap=3.0),
            "T5 table": dict(bias=mpiring.masks.t5_bias(table, max_distance=20)),
            "T5 table, then score_mod": dict(bias=mpiring.masks.t5_bias(table, bidirectional=False, max_distance=20),
                                             score_mod=log_gelu, score_mod_grad=log_gelu_grad)}


def _applies(strategy, P):
    return not ((strategy == "ulysses" and H % P) or (strategy == "grid" and P % 2))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_score_mods_and_tables_match_the_reference(strategy):
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    if not _applies(strategy, P):
        pytest.skip(f"{strategy} does not run on {P} ranks")
    q, k, v, dout, table = _arrays()
    for n, (name, opts) in enumerate(modifiers(table).items()):
        turn = n + list(STRATEGIES).index(strategy)
        layout, mask = LAYOUTS[turn % 2], MASKS[turn % len(MASKS)]
        kw = dict(opts, **mask)
        want_out, want_lse = mpiring.testing.reference(q, k, v, **kw)
        want = mpiring.testing.reference_backward(dout, q, k, v, **kw)
        i = mpiring.shard_indices(S, P, r, layout)
        kw.update(layout=layout, **STRATEGIES[strategy])
        out, lse = mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, **kw)
        grads = mpiring.ring_attention_backward(dout[..., i, :], q[..., i, :], k[..., i, :], v[..., i, :], out, lse,
                                                comm, **kw)
        where = f"{name}, {strategy}, {layout}, {mask}, P={P}"
        np.testing.assert_allclose(out, want_out[..., i, :], atol=1e-11, rtol=0, err_msg=where)
        np.testing.assert_allclose(lse, want_lse[..., i], atol=1e-11, rtol=0, err_msg=where)
        assert len(grads) == len(want) == (4 if "bias" in opts else 3), where
        for label, got, ref in zip(("dq", "dk", "dv"), grads, want):
            np.testing.assert_allclose(got, ref[..., i, :], atol=1e-11, rtol=0, err_msg=f"{label}: {where}")
        if "bias" in opts:  # d table: summed over the ranks, the same on every rank
            np.testing.assert_allclose(grads[3], want[3], atol=1e-11, rtol=0, err_msg=f"d table: {where}")
            assert np.abs(want[3]).max() > 1e-3, "the table's gradient is not trivially zero"


def test_decode_takes_a_score_mod_and_a_table():
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, _, table = _arrays(2)
    kw = dict(score_mod=checker_half, bias=mpiring.masks.t5_bias(table, max_distance=20))
    want_out, want_lse = mpiring.testing.reference(q[..., -3:, :], k, v, q_positions=np.arange(S - 3, S),
                                                   causal=True, **kw)
    i = mpiring.shard_indices(S, P, r, "zigzag")
    out, lse = mpiring.decode_attention(q[..., -3:, :], k[..., i, :], v[..., i, :], comm, causal=True,
                                        positions=np.arange(S - 3, S), kv_positions=i, **kw)
    np.testing.assert_allclose(out, want_out, atol=1e-11, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-11, rtol=0)


def test_a_backward_without_the_derivative_is_refused_on_every_rank():
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, dout, _ = _arrays()
    i = mpiring.shard_indices(S, P, r, "zigzag")
    a = [x[..., i, :] for x in (dout, q, k, v)]
    out, lse = mpiring.ring_attention(*a[1:], comm, layout="zigzag", causal=True, score_mod=log_gelu)
    with pytest.raises(ValueError, match="the score_mod 'log_gelu' has no derivative"):
        mpiring.ring_attention_backward(*a, out, lse, comm, layout="zigzag", causal=True, score_mod=log_gelu)


def test_a_score_mod_or_table_that_differs_between_ranks_is_every_ranks_error():
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    if P == 1:
        pytest.skip("needs two ranks")
    q, k, v, _, table = _arrays()
    i = mpiring.shard_indices(S, P, r)
    factor = 0.5 if r == P - 1 else 0.25

    def scaled(s, b, h, qi, ki):
        return s * factor
    with pytest.raises(ValueError, match="score_mod differs from rank"):
        mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, score_mod=scaled)
    table[1, 3] += r == P - 1
    with pytest.raises(ValueError, match="bias differs from rank"):
        mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, bias=mpiring.masks.t5_bias(table))


def test_a_failing_score_mod_is_named_on_every_rank():
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, _, _ = _arrays()
    i = mpiring.shard_indices(S, P, r)
    hits = np.zeros(S - 1)  # one short: the last key fails

    def looked_up(s, b, h, qi, ki):
        return s + hits[ki]
    with pytest.raises(ValueError, match="the score_mod .*looked_up.* fails on"):
        mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, score_mod=looked_up)
    out, lse = mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, score_mod=checker_half)
    with pytest.raises(ValueError, match="the score_mod_grad .*looked_up.* fails on"):
        mpiring.ring_attention_backward(out, q[..., i, :], k[..., i, :], v[..., i, :], out, lse, comm,
                                        score_mod=checker_half, score_mod_grad=looked_up)


def test_the_torch_adapter_trains_a_table_and_derives_the_derivative():
    """mpiring.torch: a score_mod in torch ops (derivative by autograd), a T5 table as an nn.Parameter whose
    gradients summed over the ranks (as replicated parameters' are) give d table."""
    torch = pytest.importorskip("torch")
    import mpiring.torch
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    q, k, v, dout, table = _arrays(4)

    def tmod(s, b, h, qi, ki):
        return torch.where((qi + ki) % 2 == 0, 0.5 * s, torch.nn.functional.gelu(s)) + 0.25 * h

    def fn(s, b, h, qi, ki):
        return np.where((qi + ki) % 2 == 0, 0.5 * s, s * _cdf(s)) + 0.25 * h

    def dfn(s, b, h, qi, ki):
        return np.where((qi + ki) % 2 == 0, 0.5, _cdf(s) + s * np.exp(-s * s / 2) / math.sqrt(2 * math.pi))
    kw = dict(causal=True, window=(9, 0), bias=mpiring.masks.t5_bias(table, max_distance=20))
    want_out, _ = mpiring.testing.reference(q, k, v, score_mod=fn, **kw)
    want = mpiring.testing.reference_backward(dout, q, k, v, score_mod=fn, score_mod_grad=dfn, **kw)
    i = mpiring.shard_indices(S, P, r, "zigzag")
    param = torch.nn.Parameter(torch.tensor(table))
    t = [torch.tensor(x[..., i, :], requires_grad=True) for x in (q, k, v)]
    out = mpiring.torch.ring_attention(*t, comm=comm, layout="zigzag", score_mod=tmod,
                                       **dict(kw, bias=mpiring.masks.t5_bias(param, max_distance=20)))
    (out * torch.tensor(dout[..., i, :])).sum().backward()
    np.testing.assert_allclose(out.detach().numpy(), want_out[..., i, :], atol=1e-11, rtol=0)
    for x, ref in zip(t, want):
        np.testing.assert_allclose(x.grad.numpy(), ref[..., i, :], atol=1e-11, rtol=0)
    share = param.grad.numpy()  # each rank's 1/P share: summed over the ranks as replicated parameters are
    np.testing.assert_allclose(comm.allreduce(share), want[3], atol=1e-11, rtol=0)
