"""The reusable ``Ring`` handle: agreed once, called many times, a backward that cannot differ from its forward.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_handle_mpi.py
"""

import itertools
import pickle

import numpy as np
import pytest
from mpi4py import MPI

import mpiring
from mpiring import LAYOUTS, MODES, Lse, Ring, ring_attention, ring_attention_backward

from conftest import GRAD_TOL, dense_mask, local, naive_attention, naive_attention_backward

# the handle's behaviour (errors, kept buffers, threads, modes) at P = 1 and 2 in the quick suite; its results
# over many calls in every layout x mode at every P (run/test --full: all of it at every P)
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2)]

TOL = GRAD_TOL[np.float64]


def _problem(S, heads=4, kv_heads=2, dim=8, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    Q = rng.standard_normal((2, heads, S, dim)).astype(dtype)
    K, V = (rng.standard_normal((2, kv_heads, S, dim)).astype(dtype) for _ in range(2))
    return Q, K, V, rng.standard_normal(Q.shape).astype(dtype)


MASKS = [dict(causal=False), dict(causal=True), dict(causal=True, window=(3, 0)),
         dict(causal=False, window=(2, 5), cu_seqlens=[0, 4, 9, 23])]


@pytest.mark.parametrize("layout, mode", list(itertools.product(LAYOUTS, MODES)))
@pytest.mark.ranks(1, 2, 3, 4)
def test_handle_matches_reference_over_many_calls(comm, layout, mode):
    """One handle, every mask's problem twice: forward and backward equal the dense reference every call."""
    S = 23
    for i, mask_options in enumerate(MASKS):
        mask = dense_mask(S, **mask_options)
        with Ring(comm, S, layout=layout, mode=mode, **mask_options) as ring:
            for call in range(2):
                Q, K, V, dOut = _problem(S, seed=10 * i + call)
                q, k, v, dout = (local(x, comm, layout) for x in (Q, K, V, dOut))
                out, lse = ring.forward(q, k, v)
                dq, dk, dv = ring.backward(dout, q, k, v, out, lse)
                want = [naive_attention(Q, K, V, mask)] + list(naive_attention_backward(dOut, Q, K, V, mask))
                for name, got, ref in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), want):
                    err = np.max(np.abs(got - local(ref, comm, layout)))
                    assert err < TOL, f"{name} {layout} {mode} {mask_options} call {call}: {err:.2e}"


def test_handle_equals_functions_and_counts_per_call(comm):
    """Bit for bit the functions' results; each call's Record holds that call's bytes, not a running total."""
    S, options = 40, dict(causal=True, layout="zigzag")
    Q, K, V, dOut = _problem(S, dtype=np.float32)
    q, k, v, dout = (local(x, comm, "zigzag") for x in (Q, K, V, dOut))
    once, once_back = mpiring.Record(), mpiring.Record()
    out_f, lse_f = ring_attention(q, k, v, comm, record=once, **options)
    grads_f = ring_attention_backward(dout, q, k, v, out_f, lse_f, comm, record=once_back, **options)
    assert comm.size == 1 or once.bytes_sent > 0
    with Ring(comm, S, **options) as ring:
        for _ in range(3):
            forward, backward = mpiring.Record(), mpiring.Record()
            out, lse = ring.forward(q, k, v, record=forward)
            grads = ring.backward(dout, q, k, v, out, lse, record=backward)
            np.testing.assert_array_equal(out, out_f)
            np.testing.assert_array_equal(lse, lse_f)
            for g, gf in zip(grads, grads_f):
                assert g.dtype == np.float32
                np.testing.assert_array_equal(g, gf)
            assert (forward.bytes_sent, forward.messages) == (once.bytes_sent, once.messages)
            assert (backward.bytes_sent, backward.messages) == (once_back.bytes_sent, once_back.messages)
            assert forward.tasks == once.tasks


@pytest.mark.parametrize("mode", MODES)
def test_backward_communicators_made_at_the_first_backward(comm, mode):
    """A Ring given seq_len duplicates only the forward's communicators; the first backward adds its own (on every
    rank at once), and the gradients are the one-call function's."""
    S, options = 4 * comm.size + 1, dict(causal=True, layout="zigzag", mode=mode)
    Q, K, V, dOut = _problem(S)
    q, k, v, dout = (local(x, comm, "zigzag") for x in (Q, K, V, dOut))
    with Ring(comm, S, **options) as ring:
        assert len(ring._rings) == 1
        out, lse = ring.forward(q, k, v)
        assert len(ring._rings) == 1
        grads = ring.backward(dout, q, k, v, out, lse)
        made = len(ring._rings)
        assert made > 1 or comm.size == 1 or mode == "allgather"
        ring.backward(dout, q, k, v, out, lse)
        assert len(ring._rings) == made
    for got, want in zip(grads, ring_attention_backward(dout, q, k, v, out, lse, comm, **options)):
        np.testing.assert_array_equal(got, want)

@pytest.mark.parametrize("layout", LAYOUTS)
def test_seq_axis_bshd(comm, layout):
    """(B, S, H, D) tensors with seq_axis=-3: the same numbers as (B, H, S, D), results in (B, S, H, D)."""
    S = 21
    Q, K, V, dOut = _problem(S)
    q, k, v, dout = (local(x, comm, layout) for x in (Q, K, V, dOut))
    out, lse = ring_attention(q, k, v, comm, causal=True, layout=layout)
    grads = ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True, layout=layout)
    bshd = [np.swapaxes(x, 1, 2) for x in (q, k, v, dout)]  # non-contiguous views, as a transpose gives
    with Ring(comm, S, causal=True, layout=layout, seq_axis=-3) as ring:
        out2, lse2 = ring.forward(*bshd[:3])
        grads2 = ring.backward(bshd[3], *bshd[:3], out2, lse2)
    out3, lse3 = ring_attention(*bshd[:3], comm, causal=True, layout=layout, seq_axis=1)
    grads3 = ring_attention_backward(bshd[3], *bshd[:3], out3, lse3, comm, causal=True, layout=layout, seq_axis=1)
    for o, l_ in ((out2, lse2), (out3, lse3)):
        assert o.shape == bshd[0].shape and l_.shape == lse.shape
        np.testing.assert_allclose(np.swapaxes(o, 1, 2), out, atol=1e-14)
        np.testing.assert_allclose(l_, lse, atol=1e-14)
    for gs in (grads2, grads3):
        for g, ref in zip(gs, grads):
            np.testing.assert_allclose(np.swapaxes(g, 1, 2), ref, atol=1e-13)


def test_backward_with_other_options_raises_everywhere(comm):
    """The issue's silent error: a backward without the forward's window now raises on every rank."""
    S = 24
    Q, K, V, dOut = _problem(S)
    q, k, v, dout = (local(x, comm) for x in (Q, K, V, dOut))
    out, lse = ring_attention(q, k, v, comm, causal=True, window=(3, 0))
    with pytest.raises(ValueError, match=r"lse was made by a forward with other options \(window=\(3, 0\) there"):
        ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True)
    with pytest.raises(ValueError, match="scale=.* there"):
        ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True, window=(3, 0), scale=0.5)
    # a copy keeps the tag; the matching call works
    ring_attention_backward(dout, q, k, v, out, lse.copy(), comm, causal=True, window=(3, 0))
    with Ring(comm, S, causal=True) as ring:  # a handle with other options refuses it too
        with pytest.raises(ValueError, match="lse was made by a forward with other options"):
            ring.backward(dout, q, k, v, out, lse)
        # an untagged lse (np.asarray drops the tag) is taken on trust, as before
        ring.backward(dout, q, k, v, out, np.asarray(lse))
        out2, lse2 = ring.forward(q, k, v)  # the handle still works after the refused call
        ring.backward(dout, q, k, v, out2, lse2)


def test_lse_tag_travels():
    a = np.arange(6.0).reshape(2, 3).view(Lse)
    a.made_by = {"window": (3, 0)}
    assert a[0].made_by == a.copy().made_by == pickle.loads(pickle.dumps(a)).made_by == {"window": (3, 0)}
    assert type(a + 1) is np.ndarray and type(np.exp(a)) is np.ndarray
    assert type(a.max()) is np.float64


def test_bad_call_raises_everywhere_and_handle_stays_usable(comm):
    S = 20
    Q, K, V, dOut = _problem(S)
    q, k, v, dout = (local(x, comm) for x in (Q, K, V, dOut))
    with Ring(comm, S, causal=True) as ring:
        bad_q = q[..., :4] if comm.rank == comm.size - 1 else q  # one rank's head dim differs
        with pytest.raises(ValueError, match=f"rank {comm.size - 1}: q and k must have the same head dim"):
            ring.forward(bad_q, k, v)
        short = [a[..., 1:, :] if comm.rank == 0 else a for a in (q, k, v)]
        with pytest.raises(ValueError, match="rank 0: q holds"):
            ring.forward(*short)
        if comm.size > 1:
            other = q.astype(np.float32) if comm.rank == 1 else q
            k2, v2 = (a.astype(np.float32) if comm.rank == 1 else a for a in (k, v))
            with pytest.raises(ValueError, match="rank 1: dtype 'float32' differs from rank 0's 'float64'"):
                ring.forward(other, k2, v2)
        with pytest.raises(ValueError, match="the logits may overflow"):
            ring.forward(q * (1e160 if comm.rank == 0 else 1), k * 1e160, v)
        out, lse = ring.forward(q, k, v)
        mask = dense_mask(S, causal=True)
        assert np.max(np.abs(out - local(naive_attention(Q, K, V, mask), comm))) < TOL
        with pytest.raises(ValueError, match="dout must have shape"):
            ring.backward(dout[..., :3], q, k, v, out, lse)
    with pytest.raises(RuntimeError, match="cannot be used any more: it was closed"):
        ring.forward(q, k, v)


def test_bad_construction_raises_everywhere(comm):
    with Ring(comm, None) as ring, pytest.raises(RuntimeError, match="its shards are known after its first call"):
        ring.shard(np.zeros(4))  # no seq_len: the Ring agrees at its first call (the ranks' shards add up)
    with pytest.raises(ValueError, match="need at least one token per rank"):
        Ring(comm, comm.size - 1)
    with pytest.raises(ValueError, match="threads must be"):
        Ring(comm, 8, threads=0)
    with pytest.raises(ValueError, match="seq_axis must be an int or a string such as 'bshd' or 'bhsd', got 1.5"):
        Ring(comm, 8, seq_axis=1.5)
    with pytest.raises(ValueError, match="seq_axis must be an int or a string naming every axis, 's' the sequence"):
        Ring(comm, 8, seq_axis="bthd")
    if comm.size > 1:
        with pytest.raises(ValueError, match="rank 1: causal True differs from rank 0's False"):
            Ring(comm, 8, causal=comm.rank == 1)


def test_dlse_gradient(comm):
    """A loss that uses lse too: its gradient enters as delta - dlse; checked against dense formulas."""
    S, scale = 22, 0.4
    Q, K, V, dOut = _problem(S, kv_heads=4)
    G = np.random.default_rng(5).standard_normal(Q.shape[:-1])  # d loss / d lse
    mask = dense_mask(S, causal=True)
    dq_ref, dk_ref, dv_ref = naive_attention_backward(dOut, Q, K, V, mask, scale)
    s = np.where(mask, scale * Q @ np.swapaxes(K, -1, -2), -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dq_ref = dq_ref + scale * G[..., None] * (p @ K)  # d lse_i / d q_i = scale * sum_j p_ij k_j
    dk_ref = dk_ref + scale * np.swapaxes(p * G[..., None], -1, -2) @ Q
    q, k, v, dout, g = (local(x, comm) for x in (Q, K, V, dOut, G[..., None]))
    with Ring(comm, S, causal=True, scale=scale, mode="bidirectional") as ring:
        out, lse = ring.forward(q, k, v)
        grads = ring.backward(dout, q, k, v, out, lse, dlse=g[..., 0])
    for got, ref in zip(grads, (dq_ref, dk_ref, dv_ref)):
        assert np.max(np.abs(got - local(ref, comm))) < TOL


def test_blas_threads_limited_inside_calls_and_restored(comm, monkeypatch):
    """threads=2 inside every call (seen from the kernel), BLAS as it was afterwards."""
    from threadpoolctl import threadpool_info

    from mpiring.core import block

    def blas_threads():  # NumPy's BLAS; MKL, when core.tuning.gemm loaded it, runs sequential whatever the limit
        return [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas" and p["internal_api"] != "mkl"]

    before = blas_threads()
    seen = []
    attend = block.attend

    def spy(*args, **kwargs):
        seen.append(blas_threads())
        return attend(*args, **kwargs)

    monkeypatch.setattr(block, "attend", spy)
    Q, K, V, _ = _problem(8 * comm.size)
    q, k, v = (local(x, comm) for x in (Q, K, V))
    ring_attention(q, k, v, comm, threads=2)
    with Ring(comm, 8 * comm.size, threads=1) as ring:
        ring.forward(q, k, v)
    assert seen and all(s == [2] * len(before) for s in seen[:comm.size])
    assert all(s == [1] * len(before) for s in seen[comm.size:])
    assert blas_threads() == before


def _fail_inside(ring, q, k, v, monkeypatch):
    """A forward call that raises KeyboardInterrupt inside the ring, from ``block.attend``."""
    from mpiring.core import block

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(block, "attend", boom)
    with pytest.raises(KeyboardInterrupt):
        ring.forward(q, k, v)
    monkeypatch.undo()


def test_forward_only_handle_refuses_backward_after_failure(comm, monkeypatch):
    """A call that fails inside the ring closes the handle: later calls say why instead of hanging."""
    S = 4 * comm.size
    Q, K, V, dOut = _problem(S)
    q, k, v = (local(x, comm) for x in (Q, K, V))
    ring = Ring(comm, S)
    _fail_inside(ring, q, k, v, monkeypatch)
    with pytest.raises(RuntimeError, match="a call failed in the ring"):
        ring.forward(q, k, v)
    ring.close()
    MPI.COMM_WORLD.Barrier()


def _kept():
    """Names of the ring's buffers this thread keeps between calls."""
    from mpiring.core import tiles

    return {name for name, _ in getattr(tiles._workspace, "bufs", {}) if name.startswith(("ring.", "bwd."))}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal, layout", [(False, "contiguous"), (True, "zigzag")])
def test_results_do_not_share_the_kept_buffers(comm, dtype, causal, layout):
    """The ring keeps its accumulators and receive slots between calls: what a call returned stays as it was."""
    S = 24 * comm.size + 1
    first, second = _problem(S, dtype=dtype), _problem(S, seed=1, dtype=dtype)
    mask = dense_mask(S, causal=causal)
    tol = TOL if dtype == np.float64 else 2e-5
    with Ring(comm, S, causal=causal, layout=layout) as ring:
        kept = []
        for Q, K, V, dOut in (first, second, first):
            q, k, v, dout = (ring.shard(x) for x in (Q, K, V, dOut))
            out, lse = ring.forward(q, k, v)
            grads = ring.backward(dout, q, k, v, out, lse)
            kept.append((out, *grads, (out.copy(), *(g.copy() for g in grads))))
        for (out, *grads, copies), (Q, K, V, dOut) in zip(kept, (first, second, first)):
            for now, then in zip((out, *grads), copies):  # not overwritten by the calls after it
                assert np.array_equal(now, then)
            ref = naive_attention_backward(*(x.astype(np.float64) for x in (dOut, Q, K, V)), mask)
            for got, want in zip(grads, ref):
                assert np.max(np.abs(got - ring.shard(want))) < tol
            want = naive_attention(*(x.astype(np.float64) for x in (Q, K, V)), mask)
            assert np.max(np.abs(out - ring.shard(want))) < tol
        assert np.array_equal(kept[0][0], kept[2][0])  # the same inputs give the same bits, whatever was kept
    if dtype == np.float32:  # a converted copy of the float64 running out is returned: that was kept
        assert "ring.out" in _kept()
    assert not {"bwd.dk", "bwd.dv"} & _kept()  # the gradient sums are the results (Precision.sums): never kept
    mpiring.release_workspace()
    assert not _kept()


def test_failed_call_drops_the_kept_buffers(comm, monkeypatch):
    """After a call fails in the ring, an abandoned receive may still land in a kept buffer: none is kept."""
    S = 8 * comm.size
    Q, K, V, _ = _problem(S, dtype=np.float32)
    with Ring(comm, S) as ring:
        ring.forward(*(ring.shard(x) for x in (Q, K, V)))
        assert "ring.out" in _kept()
    ring = Ring(comm, S)
    _fail_inside(ring, *(ring.shard(x) for x in (Q, K, V)), monkeypatch)
    assert not _kept()
    ring.close()
    MPI.COMM_WORLD.Barrier()


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_handle_half_inputs_and_wires_equal_functions(comm, dtype):
    """Half inputs and coded wires through the handle: bit for bit the functions'; the wire is part of the lse's
    options, so a backward with another wire raises."""
    if dtype == "bfloat16":
        dtype = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes").bfloat16
    S, options = 30, dict(causal=True, layout="striped", wire_dtype="int8")
    Q, K, V, dOut = (x.astype(dtype) for x in _problem(S))
    q, k, v, dout = (local(x, comm, "striped") for x in (Q, K, V, dOut))
    out_f, lse_f = ring_attention(q, k, v, comm, **options)
    grads_f = ring_attention_backward(dout, q, k, v, out_f, lse_f, comm, **options)
    with Ring(comm, S, **options) as ring:
        out, lse = ring.forward(q, k, v)
        grads = ring.backward(dout, q, k, v, out, lse)
    assert out.dtype == dtype and lse.dtype == np.float32
    np.testing.assert_array_equal(out.astype(np.float32), out_f.astype(np.float32))
    for g, gf in zip(grads, grads_f):
        assert g.dtype == dtype
        np.testing.assert_array_equal(g.astype(np.float32), gf.astype(np.float32))
    with pytest.raises(ValueError, match="wire_dtype='int8' there, None here"):
        ring_attention_backward(dout, q, k, v, out, lse, comm, causal=True, layout="striped")


@pytest.mark.parametrize("options", [dict(mode="ulysses"), dict(mode="double_ring", node_size=1),
                                     dict(mode="ring", layout="zigzag", ulysses_size=2), dict(mode="double_ring")])
def test_handle_other_modes(comm, options):
    """Ulysses, the double ring and the ring x Ulysses grid through one handle, twice: the reference each call."""
    if options.get("ulysses_size", 1) > 1 and comm.size % options["ulysses_size"]:
        options = dict(options, ulysses_size=1)
    S = 4 * comm.size + 1
    mask = dense_mask(S, causal=True)
    sent = []
    with Ring(comm, S, causal=True, **options) as ring:
        for call in range(2):
            Q, K, V, dOut = _problem(S, heads=12, kv_heads=12, seed=call)
            q, k, v, dout = (ring.shard(x) for x in (Q, K, V, dOut))
            rec = mpiring.Record()
            out, lse = ring.forward(q, k, v, record=rec)
            sent.append(rec.bytes_sent)
            grads = ring.backward(dout, q, k, v, out, lse)
            want = [naive_attention(Q, K, V, mask)] + list(naive_attention_backward(dOut, Q, K, V, mask))
            for got, ref in zip((out, *grads), want):
                assert np.max(np.abs(got - ring.shard(ref))) < TOL, (options, call)
    assert sent[0] == sent[1], f"each call's Record counts that call's bytes: {sent}"


@pytest.mark.parametrize("rotate", ["q", "auto"])
def test_handle_pass_q(comm, rotate):
    """rotate='q' (queries travel) through a handle: the K/V ring's results, the choice in the Record."""
    S = 6 * comm.size
    Q, K, V, dOut = _problem(S)
    q, k, v, dout = (local(x, comm) for x in (Q, K, V, dOut))
    out_kv, lse_kv = ring_attention(q, k, v, comm, causal=True)
    with Ring(comm, S, causal=True, rotate=rotate) as ring:
        rec = mpiring.Record()
        out, lse = ring.forward(q, k, v, record=rec)
        grads = ring.backward(dout, q, k, v, out, lse)
    assert rec.rotate in ("q", "kv") and (rotate == "auto" or rec.rotate == "q")
    np.testing.assert_allclose(out, out_kv, atol=1e-13)
    np.testing.assert_allclose(lse, lse_kv, atol=1e-13)
    mask = dense_mask(S, causal=True)
    for got, ref in zip(grads, naive_attention_backward(dOut, Q, K, V, mask)):
        assert np.max(np.abs(got - local(ref, comm))) < TOL
    with Ring(comm, S, causal=True, rotate=rotate, wire_dtype="int8") as ring:  # coded query blocks (or K/V)
        np.testing.assert_allclose(ring.forward(q, k, v)[0], out_kv, atol=4e-2)
