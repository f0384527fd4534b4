"""The sequence mixers' NumPy core, plans and byte model, without MPI.

    python -m pytest -q tests/test_mixers.py

The chunked kernels (a decay per head or per key dimension, the gated delta
rule) against the token-by-token float64 loops of ``core.mixers.sequential``,
forward and backward, from any incoming state and for any block size; those
loops against torch autograd of a plain loop (where torch is installed); the
affine maps; the convolution over gathered rows; which chunks each layout
makes and in which order the state passes; the halo rows; and the byte model.
"""

import numpy as np
import pytest

from mpiring import MixerSpec
from mpiring.core.mixers.affine import Affine, apply, compose, cut
from mpiring.core.mixers.conv import conv_rows, conv_rows_backward
from mpiring.core.mixers.decay import decay_backward, decay_forward
from mpiring.core.mixers.delta import delta_backward, delta_forward
from mpiring.core.mixers.runs import corrected, run_forward
from mpiring.core.mixers.sequential import conv, conv_backward, recurrence, recurrence_backward
from mpiring.core.mixers.ssm import RecurrenceGrads, scan_grads, scan_inputs, ssd_grads, ssd_inputs
from mpiring.cost.statebytes import exscan_rounds, halo_bytes, state_bytes
from mpiring.plans.layouts import shard_indices

from conftest import needs_torch

KINDS = ["none", "head", "key"]  # no decay, one per head (Z, n), one per key dimension (Z, n, dk)


def problem(rng, kind, n, Z=3, dk=4, dv=5, beta=False, dtype=np.float64):
    """Random q, k, v, log decay and beta (k unit-norm for the delta rule, as models normalize it)."""
    q, k, v = (rng.standard_normal((Z, n, d)).astype(dtype) for d in (dk, dk, dv))
    if beta:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    g = {"none": None, "head": -rng.random((Z, n)), "key": -rng.random((Z, n, dk))}[kind]
    return q, k, v, None if g is None else g.astype(dtype), rng.random((Z, n)).astype(dtype) if beta else None


def close(got, want, tol=1e-12, what=""):
    """|got - want| <= tol * max(1, max |want|), with the error in the message."""
    err = float(np.max(np.abs(np.asarray(got) - want))) if np.size(want) else 0.0
    assert err <= tol * max(1.0, float(np.max(np.abs(want)))), f"{what}: error {err:.3g}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n,block", [(1, 4), (4, 4), (5, 4), (17, 16), (40, 1), (33, 64)])
def test_decay_kernel_matches_the_loop(rng, kind, n, block):
    q, k, v, g, _ = problem(rng, kind, n)
    state, dfinal, dout = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5)), rng.standard_normal((3, n, 5))
    out, final = decay_forward(q, k, v, g, state, block)
    ref_out, ref_final = recurrence(q, k, v, g=g, state=state)
    close(out, ref_out, what="out")
    close(final, ref_final, what="final state")
    got = decay_backward(dout, q, k, v, g, state, dfinal, block)
    ref = recurrence_backward(dout, q, k, v, g=g, state=state, dfinal=dfinal)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dstate"), got, ref[:4] + ref[5:]):
        assert (a is None) == (b is None), name
        if a is not None:
            close(a, b, what=name)


@pytest.mark.parametrize("kind", KINDS[:2])
@pytest.mark.parametrize("n,block", [(1, 4), (5, 4), (16, 4), (17, 16), (40, 64), (23, 1)])
def test_delta_kernel_matches_the_loop(rng, kind, n, block):
    q, k, v, g, beta = problem(rng, kind, n, beta=True)
    state, dfinal, dout = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5)), rng.standard_normal((3, n, 5))
    out, final = delta_forward(q, k, v, beta, g, state, block)
    ref_out, ref_final = recurrence(q, k, v, g=g, beta=beta, state=state)
    close(out, ref_out, what="out")
    close(final, ref_final, what="final state")
    got = delta_backward(dout, q, k, v, beta, g, state, dfinal, block)
    ref = recurrence_backward(dout, q, k, v, g=g, beta=beta, state=state, dfinal=dfinal)
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dstate"), got, ref):
        assert (a is None) == (b is None), name
        if a is not None:
            close(a, b, what=name)


@pytest.mark.parametrize("kind,beta", [("head", False), ("key", False), ("head", True)])
def test_float32_kernels(rng, kind, beta):
    q, k, v, g, b = problem(rng, kind, 37, beta=beta, dtype=np.float32)
    out = delta_forward(q, k, v, b, g)[0] if beta else decay_forward(q, k, v, g)[0]
    assert out.dtype == np.float32
    close(out, recurrence(q, k, v, g=g, beta=b)[0], tol=1e-5, what="float32 out")


@pytest.mark.parametrize("kind,beta", [("none", False), ("head", False), ("key", False), ("head", True)])
def test_a_run_is_affine_in_its_incoming_state(rng, kind, beta):
    """out = out_local + entry S_in and S_out = A S_in + b: what the correction and the scans rely on."""
    q, k, v, g, b = problem(rng, kind, 19, beta=beta)
    incoming = rng.standard_normal((3, 4, 5))
    local = run_forward(q, k, v, g, b, block=8)
    want_out, want_final = recurrence(q, k, v, g=g, beta=b, state=incoming)
    close(corrected(local, incoming), want_out, what="corrected out")
    close(apply(local.map.A, incoming) + local.map.b, want_final, what="A S_in + b")
    assert local.map.A.shape == {"none": (3,), "head": (3,), "key": (3, 4)}[kind] if not beta else (3, 4, 4)


@pytest.mark.parametrize("shape", [(3,), (3, 4), (3, 4, 4)])
def test_compose_is_associative_not_commutative(rng, shape):
    maps = [Affine(rng.standard_normal(shape), rng.standard_normal((3, 4, 2))) for _ in range(3)]
    left = compose(maps[2], compose(maps[1], maps[0]))
    right = compose(compose(maps[2], maps[1]), maps[0])
    close(left.A, right.A)
    close(left.b, right.b)
    swapped = compose(maps[0], maps[1])
    assert not np.allclose(compose(maps[1], maps[0]).b, swapped.b)
    state = rng.standard_normal((3, 4, 2))
    close(apply(left.A, state) + left.b, apply(maps[2].A, apply(maps[1].A, apply(maps[0].A, state) + maps[0].b)
                                             + maps[1].b) + maps[2].b)
    assert not np.any(cut(maps[0]).A)


@pytest.mark.parametrize("cu", [None, [0, 3, 4, 12, 20]])
def test_conv_rows_is_the_loop_on_one_rank(rng, cu):
    x, weight, bias, dy = rng.standard_normal((2, 20, 3)), rng.standard_normal((3, 4)), rng.standard_normal(3), \
        rng.standard_normal((2, 20, 3))
    plan = MixerSpec.of(seq_len=20, cu_seqlens=cu).plan(1)
    taps = plan.halo(4, 0).taps
    src = np.concatenate([x, np.zeros((2, 1, 3))], axis=1)
    starts = None if cu is None else np.isin(np.arange(20), cu[:-1])
    close(conv_rows(src, taps, weight, bias), conv(x, weight, bias, starts))
    dsrc, dweight, dbias = conv_rows_backward(dy, src, taps, weight, bias)
    for a, b in zip((dsrc[:, :-1], dweight, dbias), conv_backward(dy, x, weight, bias, starts)):
        close(a, b)


def test_chunks_and_the_order_states_pass():
    """Contiguous: one chunk per rank; zigzag: two (the middle rank's two meet: one); striped: one per token;
    the chain runs in sequence order and restarts at every document."""
    P, S = 4, 32
    for layout, chunks in (("contiguous", P), ("zigzag", 2 * P - 1), ("striped", S)):
        plan = MixerSpec.of(seq_len=S, layout=layout).plan(P)
        assert plan.chunks == chunks
        chain = plan.chain()
        firsts = plan.first[chain.chunk]
        assert list(firsts) == sorted(firsts) and chain.cut.tolist() == [True] + [False] * (chunks - 1)
        owners = [int(np.flatnonzero([f in shard_indices(S, P, r, layout) for r in range(P)])[0]) for f in firsts]
        assert owners == chain.owner.tolist()
    zigzag = MixerSpec.of(seq_len=S, layout="zigzag").plan(P).chain()
    assert zigzag.owner.tolist() == [0, 1, 2, 3, 2, 1, 0]  # not rank order
    back = MixerSpec.of(seq_len=S, layout="zigzag").plan(P).chain(reverse=True)
    assert back.owner.tolist() == [0, 1, 2, 3, 2, 1, 0] and back.cut.tolist() == [True] + [False] * 6
    docs = MixerSpec.of(seq_len=S, cu_seqlens=[0, 5, 8, 32]).plan(P)
    assert docs.first.tolist() == [0, 5, 8, 16, 24] and docs.chain().cut.tolist() == [True, True, True, False, False]
    assert docs.chain(reverse=True).cut.tolist() == [True, False, False, True, True]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_halo_rows_are_the_taps_predecessors(layout):
    """Every tap reads the token w-1-j places back, from its own rows or the halo (never across a document)."""
    P, S, w = 3, 23, 4
    cu = [0, 7, 8, 23]
    plan = MixerSpec.of(seq_len=S, layout=layout, cu_seqlens=cu).plan(P)
    for r in range(P):
        mine, halo = shard_indices(S, P, r, layout), plan.halo(w, r)
        received = np.concatenate([shard_indices(S, P, src, layout)[plan.halo(w, src).send[r]]
                                   for src in sorted(halo.recv)] or [np.zeros(0, int)])
        assert len(received) == halo.rows == sum(halo.recv.values())
        rows = np.concatenate([mine, received, [-1]])  # the positions each source row holds; -1: zeros
        for i, p in enumerate(mine):
            start = max(c for c in cu if c <= p)
            want = [s if s >= start else -1 for s in range(p - w + 1, p + 1)]
            assert rows[halo.taps[i]].tolist() == want


def test_state_bytes_do_not_grow_with_the_sequence():
    """Contiguous and zigzag: the same bytes per rank at S = 64 and 4096, for every strategy."""
    for layout in ("contiguous", "zigzag"):
        for passing in ("ring", "allgather", "scan"):
            got = [state_bytes(MixerSpec.of(seq_len=S, layout=layout).plan(4), passing, 96, 12, 8) for S in (64, 4096)]
            assert got[0] == got[1] and max(got[0]) > 0
    ring = state_bytes(MixerSpec.of(seq_len=64).plan(4), "ring", 96, 12, 8)
    assert ring == [96 * 8] * 3 + [0]  # one state per boundary, no transition
    gather = state_bytes(MixerSpec.of(seq_len=64).plan(4), "allgather", 96, 12, 8)
    assert gather == [(96 + 12) * 8 * 3] * 4
    assert [exscan_rounds(r, 5) for r in range(5)] == [3, 2, 2, 2, 1]
    striped = state_bytes(MixerSpec.of(seq_len=64, layout="striped").plan(4), "ring", 96, 12, 8)
    assert striped == [16 * 96 * 8] * 3 + [15 * 96 * 8]  # a state per token: striped is a poor fit
    assert halo_bytes(MixerSpec.of(seq_len=64).plan(4), 4, 10, 8) == [3 * 10 * 8] * 3 + [0]
    # backward: the rows again, and the gradients of the 3 rows each rank after the first read
    assert halo_bytes(MixerSpec.of(seq_len=64).plan(4), 4, 10, 8, backward=True) == [240, 480, 480, 240]


@pytest.mark.parametrize("options,words", [(dict(passing="tree"), "passing"), (dict(layout="spiral"), "layout"),
                                           (dict(block=0), "block"), (dict(rotate="q"), "unknown"),
                                           (dict(positions=[0.5]), "positions")])
def test_spec_refuses_by_name(options, words):
    with pytest.raises(ValueError, match=words):
        MixerSpec.of(**options)


def test_plan_refuses_bad_documents_and_positions():
    with pytest.raises(ValueError, match="cu_seqlens"):
        MixerSpec.of(seq_len=10, cu_seqlens=[0, 5, 4, 10]).plan(2)
    with pytest.raises(ValueError, match="held more than once"):
        MixerSpec.of(positions=[0, 1]).plan(2, positions=[np.array([0, 1]), np.array([1, 2])])
    with pytest.raises(ValueError, match="layout"):
        MixerSpec.of(seq_len=10).plan(2, lengths=[4, 6])


def _numeric_grad(f, arrays, name, eps=1e-6):
    """Central differences of the scalar f(**arrays) with respect to arrays[name]."""
    a = arrays[name]
    grad = np.zeros_like(a)
    for i in np.ndindex(a.shape):
        old = a[i]
        a[i] = old + eps
        up = f(**arrays)
        a[i] = old - eps
        down = f(**arrays)
        a[i] = old
        grad[i] = (up - down) / (2 * eps)
    return grad


@pytest.mark.parametrize("which", ["ssd", "scan"])
def test_state_space_gradients_by_finite_differences(rng, which):
    """SSD's and the selective scan's mapping onto the recurrence and their chain rule back (dx, ddt, dA, dB, dC,
    dD) against central differences of a loop written from their definitions."""
    n, N = 6, 3
    if which == "ssd":
        arrays = dict(x=rng.standard_normal((1, 4, n, 2)), dt=rng.random((1, 4, n)), A=-rng.random(4),
                      B=rng.standard_normal((1, 2, n, N)), C=rng.standard_normal((1, 2, n, N)),
                      D=rng.standard_normal(4))
    else:
        arrays = dict(x=rng.standard_normal((1, 3, n)), dt=rng.random((1, 3, n)), A=-rng.random((3, N)),
                      B=rng.standard_normal((1, n, N)), C=rng.standard_normal((1, n, N)), D=rng.standard_normal(3))
    dy = rng.standard_normal(arrays["x"].shape)

    def loop(x, dt, A, B, C, D):
        """y of the definition, token by token."""
        y = np.zeros_like(x)
        if which == "ssd":
            h = np.zeros((4, N, 2))
            for t in range(n):
                Bt, Ct = np.repeat(B[0, :, t], 2, axis=0), np.repeat(C[0, :, t], 2, axis=0)
                h = np.exp(dt[0, :, t] * A)[:, None, None] * h + dt[0, :, t, None, None] * Bt[:, :, None] \
                    * x[0, :, t, None, :]
                y[0, :, t] = np.einsum("hnp,hn->hp", h, Ct) + D[:, None] * x[0, :, t]
        else:
            h = np.zeros((3, N))
            for t in range(n):
                h = np.exp(dt[0, :, t, None] * A) * h + dt[0, :, t, None] * B[0, t] * x[0, :, t, None]
                y[0, :, t] = h @ C[0, t] + D * x[0, :, t]
        return float(np.sum(y * dy))

    inputs, grads = (ssd_inputs, ssd_grads) if which == "ssd" else (scan_inputs, scan_grads)
    q, k, v, g = inputs(*(arrays[a] for a in "x dt A B C".split()))
    Z = int(np.prod(v.shape[:-2]))
    flat = [np.reshape(a, (Z,) + a.shape[a.ndim - (2 if a is not g or g.ndim == v.ndim else 1):]) for a in (q, k, v, g)]
    out = recurrence(*flat[:3], g=flat[3])[0]
    y = out.reshape(v.shape)[..., 0] if which == "scan" else out.reshape(v.shape)
    y = y + (arrays["D"][:, None] if which == "scan" else arrays["D"][:, None, None]) * arrays["x"]
    assert abs(float(np.sum(y * dy)) - loop(**arrays)) < 1e-12
    dout = (dy[..., None] if which == "scan" else dy).reshape(flat[2].shape)
    dq, dk, dv, dg = (a.reshape(p.shape) for a, p in zip(recurrence_backward(dout, *flat[:3], g=flat[3])[:4],
                                                         (q, k, v, g)))
    got = grads(RecurrenceGrads(dq, dk, dv, dg), dy, arrays["x"], arrays["dt"], arrays["A"], arrays["B"], arrays["D"])
    for name, a in zip("x dt A B C D".split(), got):
        close(a, _numeric_grad(loop, arrays, name), tol=1e-7, what=f"d{name}")


@needs_torch
@pytest.mark.parametrize("kind,beta", [("none", False), ("head", False), ("key", False), ("head", True),
                                       ("none", True)])
def test_the_loops_against_torch_autograd(rng, kind, beta):
    """The float64 reference's hand-written backward against torch autograd of a plain loop, documents included."""
    import torch

    n = 11
    q, k, v, g, b = problem(rng, kind, n, beta=beta)
    starts = np.isin(np.arange(n), [4, 5])  # the initial state reaches tokens 0..3
    state, dfinal, dout = rng.standard_normal((3, 4, 5)), rng.standard_normal((3, 4, 5)), rng.standard_normal((3, n, 5))
    T = {name: torch.tensor(a, requires_grad=True) for name, a in dict(q=q, k=k, v=v, g=g, b=b, s=state).items()
         if a is not None}
    S, outs = T["s"], []
    for t in range(n):
        if starts[t]:
            S = torch.zeros_like(S)
        if g is not None:
            a = torch.exp(T["g"][:, t])
            S = (a[:, None, None] if g.ndim == 2 else a[:, :, None]) * S
        kt, vt = T["k"][:, t], T["v"][:, t]
        if beta:
            r = vt - torch.einsum("zi,zij->zj", kt, S)
            S = S + T["b"][:, t, None, None] * kt[:, :, None] * r[:, None, :]
        else:
            S = S + kt[:, :, None] * vt[:, None, :]
        outs.append(torch.einsum("zi,zij->zj", T["q"][:, t], S))
    loss = (torch.stack(outs, 1) * torch.tensor(dout)).sum() + (S * torch.tensor(dfinal)).sum()
    loss.backward()
    close(torch.stack(outs, 1).detach().numpy(), recurrence(q, k, v, g=g, beta=b, state=state, starts=starts)[0])
    got = recurrence_backward(dout, q, k, v, g=g, beta=b, state=state, starts=starts, dfinal=dfinal)
    for name, a in zip(("q", "k", "v", "g", "b", "s"), got):
        if name in T:
            close(a, T[name].grad.numpy(), what=f"d{name}")
