"""The kernel backend seam: which backend computed a block, the NumPy fallback, the choice, and the ring on torch.

    python -m pytest -q tests/test_backends.py
    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_backends.py

The kernel tests (test_kernels.py, test_backward.py, test_large_logits.py,
test_nonfinite.py) run once per backend (conftest's ``each_kernel``); these
check that the torch backend did compute the blocks it claims, and that the
blocks it cannot do exactly went to the NumPy kernel, bit for bit.
"""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mpiring import Ring, ring_attention, ring_attention_backward, shard_indices
from mpiring.core import backends, kernels, tiles
from mpiring.core.reference import reference_attention, reference_attention_backward
from mpiring.core.tiles import BlockRun
from mpiring.core.tuning import machine, torch_kernel
from mpiring.plans.visibility import visible_keys
from mpiring.testing import assert_attention_close

from conftest import GRAD_TOL, needs_torch, qkv, tol


def _mask(kind, sq, sk):
    """klo, khi of ``kind`` for sq queries at the end of sk keys (a causal diagonal block when sq = sk)."""
    if kind == "full":
        return None, None
    if kind == "offset causal":  # all of the first keys, then the triangle: a zigzag block's shape
        return np.zeros(sq, int), np.minimum(np.arange(sq) + 1 + max(sk - sq, 0), sk)
    pos_q, pos_k = np.arange(sk - sq, sk), np.arange(sk)
    return visible_keys(pos_q, pos_k, causal=kind != "documents", window=(4, 0) if kind == "window" else (-1, -1),
                        cu_seqlens=np.array([0, sk // 3, sk]) if kind == "documents" else None)


def _computed_by(name, fn):
    before = backends.calls[name]
    result = fn()
    assert backends.calls[name] > before, f"the {name} backend did not compute this block"
    return result


@needs_torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("kind", ["full", "causal", "offset causal", "window", "documents"])
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 6), (6, 1), (13, 13), (9, 40), (40, 23)])
def test_torch_computes_what_it_supports(rng, dtype, kind, sq, sk):
    """Forward and backward of full, causal and masked blocks, GQA, every size: torch's ops, within tolerance."""
    q, k, v = (x.astype(dtype) for x in qkv(rng, (2, 4, sq, 8), (2, 2, sk, 8)))
    x64 = [x.astype(np.float64) for x in (q, k, v)]
    dout = rng.standard_normal(q.shape).astype(dtype)
    klo, khi = _mask(kind, sq, sk)
    ref, ref_lse = reference_attention(*x64, None, klo, khi)
    want = reference_attention_backward(dout.astype(np.float64), *x64, None, klo, khi)
    atol = tol(np.float64 if dtype == np.float64 else np.float32)
    with backends.using("torch"):
        out, lse = _computed_by("torch", lambda: backends.attention_block(q, k, v, None, klo, khi))
        grads = _computed_by("torch", lambda: backends.attention_block_backward(
            dout, q, k, v, ref.astype(dtype), ref_lse, None, klo, khi))
    assert out.dtype == lse.dtype == (np.float64 if dtype == np.float64 else np.float32)
    assert_attention_close(out, ref, dtype)
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    np.testing.assert_allclose(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(ref_lse), 0, ref_lse),
                               atol=10 * atol, rtol=0)
    for got, ref_g, name in zip(grads, want, ("dq", "dk", "dv")):
        assert got.shape == ref_g.shape and np.isfinite(got).all()
        assert_attention_close(got, ref_g, dtype, name)


@needs_torch
def test_each_torch_block_gives_freed_heap_back(rng, monkeypatch):
    """Forward and backward blocks on torch's op end with ``malloc_trim``: glibc would keep the op's freed
    outputs (docs/performance.md §17 measures what it was worth); blocks the NumPy kernel takes do not trim."""
    from mpiring.core.tuning import torch_kernel

    trims = []
    monkeypatch.setattr(torch_kernel, "trim_heap", lambda: trims.append(1))
    q, k, v = qkv(rng, (2, 40, 8))
    out, lse = reference_attention(q, k, v)
    with backends.using("torch"):
        _computed_by("torch", lambda: backends.attention_block(q, k, v))
        assert len(trims) == 1
        _computed_by("torch", lambda: backends.attention_block_backward(q, q, k, v, out, lse))
        assert len(trims) == 2
        _computed_by("numpy", lambda: backends.attention_block(q, k, v[..., :5]))  # dv != d: the NumPy kernel
        assert len(trims) == 2


@needs_torch
def test_a_call_with_fewer_threads_leaves_no_trace(rng):
    """After a block under ``threads=1`` (a BLAS limit), torch's next block gives the bits it gave before.

    Ending the limit restored OpenMP's count but not the one torch had set in its own MKL; torch reported the old
    count, the backend skipped setting it, and the float64 backward ran on with one MKL thread: other bits than a
    fresh process's (tests/test_history_mpi.py found it with MPIRING_KERNEL=torch)."""
    from mpiring.core.tuning.threads import blas_threads, limited

    if blas_threads() < 2:
        pytest.skip("BLAS runs one thread here: nothing to restore")
    q, k, v = qkv(rng, (1, 2, 23, 8), (1, 1, 23, 8))
    dout = rng.standard_normal(q.shape)
    klo, khi = _mask("window", 23, 23)
    out, lse = reference_attention(q, k, v, None, klo, khi)

    def grads():
        return _computed_by("torch", lambda: backends.attention_block_backward(dout, q, k, v, out, lse, None, klo,
                                                                               khi))

    with backends.using("torch"):
        before = grads()
        with limited(1):
            one_thread = grads()
        after = grads()
    if all(np.array_equal(a, b) for a, b in zip(before, one_thread)):
        pytest.skip("one and two threads give the same bits here: the test would not see a thread count left over")
    for a, b, name in zip(before, after, ("dq", "dk", "dv")):
        assert np.array_equal(a, b), f"{name}: other bits after a call with threads=1"


@needs_torch
@pytest.mark.parametrize("case", ["dv != d", "huge logits", "nan in k", "inf in v", "no keys", "lse beyond limit",
                                  "dlse in delta"])
def test_what_torch_cannot_do_goes_to_numpy_bit_for_bit(rng, case):
    q, k, v = qkv(rng, (2, 12, 8), (2, 10, 8), np.float32)
    if case == "dv != d":
        v = rng.standard_normal((2, 10, 4)).astype(np.float32)
    elif case == "huge logits":
        q *= np.float32(3e4)
    elif case == "nan in k":
        k[1, 3, 2] = np.nan
    elif case == "inf in v":
        v[0, 2, 1] = np.inf
    elif case == "no keys":
        k, v = k[:, :0], v[:, :0]
    out, lse = kernels.attention_block(q, k, v)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    delta = None
    if case == "lse beyond limit":
        lse = lse + np.float32(2.0 ** 14)
    elif case == "dlse in delta":
        delta = np.sum(dout * out, axis=-1) - np.float32(0.5)
    with backends.using("torch"):
        if case not in ("lse beyond limit", "dlse in delta"):
            got = _computed_by("numpy", lambda: backends.attention_block(q, k, v))
            for a, b in zip(got, (out, lse)):
                np.testing.assert_array_equal(a, b)
        if case == "huge logits":  # (its lse is beyond what any backward takes: the next case)
            return
        if case == "lse beyond limit":  # the NumPy kernel's refusal, not a wrong gradient
            with pytest.raises(FloatingPointError, match="lse"):
                backends.attention_block_backward(dout, q, k, v, out, lse)
            return
        got = _computed_by("numpy", lambda: backends.attention_block_backward(dout, q, k, v, out, lse, delta=delta))
    for a, b in zip(got, kernels.attention_block_backward(dout, q, k, v, out, lse, delta=delta)):
        np.testing.assert_array_equal(a, b)


@needs_torch
@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_torch_takes_a_block_exactly_when_its_largest_score_is_within_the_bound(rng, dtype, padded):
    """``supports`` follows the bound on the largest row norms of q and k, near it on both sides, for rows whose
    norm is sqrt(D) times their largest entry (where a bound from the largest entries alone is tight) and for
    rows with one large entry (where it is D times too high)."""
    d, scale = 8, 0.5
    limit = kernels.EXACT_ABOVE[np.dtype(dtype)] / (scale * kernels.LOG2E)  # the largest |q . k| the op takes
    for spread in (True, False):
        for ratio in (0.9, 1.1):
            q, k, v = (rng.standard_normal((2, 6, d)).astype(dtype) * 0.1 for _ in range(3))
            norm = np.sqrt(ratio * limit)  # of one row of q and one of k: their product is ratio * limit
            row = np.full(d, norm / np.sqrt(d)) if spread else np.eye(d)[0] * norm
            q[1, 2], k[0, 4] = row.astype(dtype), row.astype(dtype)
            qn, kn = (np.linalg.norm(x.astype(np.float64), axis=-1).max() for x in (q, k))
            want = bool(qn * kn * scale * kernels.LOG2E <= kernels.EXACT_ABOVE[np.dtype(dtype)])
            assert want == (ratio < 1)
            kk, vv = (tiles.pad_ones(x) if padded else x for x in (k, v))
            assert torch_kernel.supports(q, kk, vv, scale, padded=padded) == want, (spread, ratio)
    q, k, v = (rng.standard_normal((2, 6, d)).astype(dtype) for _ in range(3))
    for x, bad in ((q, np.nan), (k, np.inf), (v, -np.inf), (v, np.nan)):
        x[1, 3, 2] = bad
        kk, vv = (tiles.pad_ones(a) if padded else a for a in (k, v))
        with np.errstate(invalid="ignore"):
            assert not torch_kernel.supports(q, kk, vv, scale, padded=padded)
        x[1, 3, 2] = 0


def test_numpy_backend_is_the_kernel_bit_for_bit(rng):
    q, k, v = qkv(rng, (2, 3, 30, 8), (2, 3, 30, 8), np.float32)
    klo, khi = _mask("window", 30, 30)
    with backends.using("numpy"):
        got = _computed_by("numpy", lambda: backends.attention_block(q, k, v, None, klo, khi))
    for a, b in zip(got, kernels.attention_block(q, k, v, None, klo, khi)):
        np.testing.assert_array_equal(a, b)


def test_the_choice(monkeypatch, tmp_path):
    """A bad name raises; "auto" is the rule where torch is installed (a tuning cache's old "kernel" entry is not
    read), else numpy; ``using`` restores the choice."""
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        backends.set_backend("fast")
    if "torch" not in backends.available():
        with pytest.raises(ValueError, match="needs PyTorch"):
            backends.set_backend("torch")
    auto = "auto" if "torch" in backends.available() else "numpy"
    with backends.using("auto"):
        assert backends.backend() == auto
        cache = tmp_path / "tune.json"
        cache.write_text(json.dumps({machine.machine_key(): {"kernel": "numpy"}}))
        monkeypatch.setenv("MPIRING_TUNE_CACHE", str(cache))
        machine.cached.cache_clear()
        backends.backend.cache_clear()
        try:
            assert backends.backend() == auto
        finally:
            monkeypatch.undo()
            machine.cached.cache_clear()
            backends.backend.cache_clear()
        with backends.using("numpy"):
            assert backends.backend() == "numpy" and backends.for_block(np.float32, 10**6) == "numpy"
    assert backends.choice() == "auto"


@needs_torch
@pytest.mark.parametrize("vectorized", [True, False])
def test_auto_gives_torch_the_blocks_of_many_rows(rng, monkeypatch, vectorized):
    """"auto": torch's op from ``AUTO_ROWS`` query rows on, by dtype and pass, the NumPy kernel below (half
    inputs as float32, which they compute in); whether NumPy's exp2 is vectorized picks the row of the table."""
    monkeypatch.setattr(backends, "numpy_exp2_vectorized", lambda: vectorized)
    rules = backends.AUTO_ROWS[vectorized]
    with backends.using("auto"):
        for (dtype, kind), least in rules.items():
            backward = kind == "backward"
            for dt in [dtype] + (["float16"] if dtype == "float32" else []):
                if least is None:
                    assert backends.for_block(np.dtype(dt), 10**6, backward) == "numpy"
                    continue
                assert backends.for_block(np.dtype(dt), least, backward) == "torch"
                assert backends.for_block(np.dtype(dt), least - 1, backward) == "numpy"
                if not backward:  # the ring keeps K/V in the form of the forward's backend
                    assert not backends.takes_padded(np.dtype(dt), least)
                    assert backends.takes_padded(np.dtype(dt), least - 1)
        least = rules[("float32", "forward")]
        for rows, name in ((least, "torch"), (least - 1, "numpy")):  # the blocks themselves
            q, k, v = qkv(rng, (1, rows, 8), (1, 16, 8), np.float32)
            out, lse = _computed_by(name, lambda: backends.attention_block(q, k, v))  # noqa: B023
            want, want_lse = reference_attention(*(x.astype(np.float64) for x in (q, k, v)))
            assert_attention_close(out, want, np.float32)
            assert_attention_close(lse, want_lse, np.float32, "lse")
    with backends.using("torch"):
        assert backends.for_block(np.float64, 1) == "torch"  # a backend named: every block it can do


def test_auto_imports_torch_only_for_a_call_it_gives_torch():
    """In a fresh process with torch installed: choosing numpy, resolving "auto" and a call of few rows import nothing;
    preparing a call of many float32 rows imports torch, before any block (``plans.checks.backend_problem``)."""
    code = ("import sys, numpy as np; from mpiring.core import backends; from mpiring.core.tuning import torch_kernel; "
            "from mpiring.plans.checks import backend_problem; "
            "backends.set_backend('numpy'); backends.set_backend('auto'); "
            "print(backends.backend(), backend_problem(np.zeros((4, 16, 8), np.float32)), 'torch' in sys.modules); "
            "backend_problem(np.zeros((1, 4096, 8), np.float32)); print('torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "MPIRING_KERNEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    installed = importlib.util.find_spec("torch") is not None
    assert done.stdout.split() == (["auto", "None", "False", "True"] if installed else
                                   ["numpy", "None", "False", "False"])


def test_numpy_exp2_vectorized_follows_numpy():
    """The rule's key is NumPy's own dispatch: with its AVX-512 loops disabled, exp2 runs its baseline loop."""
    introspect = pytest.importorskip("numpy.lib.introspect")
    loops = introspect.opt_func_info(func_name="^exp2$", signature="float32")["exp2"].values()
    assert machine.numpy_exp2_vectorized() == any(not x["current"].startswith("baseline") for x in loops)
    code = "from mpiring.core.tuning import machine; print(machine.numpy_exp2_vectorized())"
    env = dict(os.environ, NPY_DISABLE_CPU_FEATURES="X86_V4 AVX512_SKX AVX512_ICL AVX512_SPR")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if done.returncode != 0:  # names NumPy does not know on this CPU (another architecture, an older NumPy)
        pytest.skip(done.stderr.strip().splitlines()[-1])
    assert done.stdout.strip() == "False"


def test_a_bad_environment_choice_raises_at_the_first_block(rng, monkeypatch):
    monkeypatch.setattr(backends._choice, "choice", "blas")
    backends.backend.cache_clear()
    try:
        with pytest.raises(ValueError, match="MPIRING_KERNEL"):
            backends.attention_block(*qkv(rng, (4, 8)))
    finally:
        monkeypatch.undo()
        backends.backend.cache_clear()


def test_one_trim_makes_the_trims_inside_once_at_its_end(monkeypatch):
    """Inside ``one_trim`` (nested too) a ``trim_heap`` waits: one ``malloc_trim`` when the outer scope ends, none
    when nothing inside asked for one; outside, every ``trim_heap`` trims."""
    trims = []
    monkeypatch.setattr(machine, "_malloc_trim", lambda: lambda pad: trims.append(pad))
    with machine.one_trim():
        with machine.one_trim():
            machine.trim_heap()
            machine.trim_heap()
        machine.trim_heap()
        assert trims == []
    assert trims == [0]
    with machine.one_trim():
        pass
    assert trims == [0]
    machine.trim_heap()
    assert trims == [0, 0]


@pytest.mark.mpi
@needs_torch
def test_a_ring_call_on_torch_trims_the_heap_once(comm, monkeypatch):
    """The ring's forward and backward on torch blocks (several per rank, key chunks too) each give the freed heap
    back once, at the end of the loop, not after every block (docs/performance.md §23)."""
    P, S = comm.size, 12 * comm.size
    rng = np.random.default_rng(5)
    Q, K, V, dOut = (rng.standard_normal((1, 2, S, 8)).astype(np.float32) for _ in range(4))
    idx = shard_indices(S, P, comm.rank, "zigzag")
    q, k, v, dout = (np.ascontiguousarray(x[..., idx, :]) for x in (Q, K, V, dOut))
    trims = []
    monkeypatch.setattr(machine, "_malloc_trim", lambda: lambda pad: trims.append(pad))
    with Ring(comm, S, causal=True, layout="zigzag") as ring, backends.using("torch"):
        for call, args in ((ring.forward, (q, k, v)), (ring.backward, (dout, q, k, v, *ring.forward(q, k, v)))):
            before, trims[:] = backends.calls["torch"], []
            call(*args)
            assert backends.calls["torch"] - before >= min(P, 2) and trims == [0], call.__name__  # P > 1: blocks


@pytest.mark.mpi
@needs_torch
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("options", [dict(), dict(causal=True, layout="zigzag"), dict(causal=True, window=(6, 0)),
                                     dict(causal=True, layout="striped"), dict(mode="bidirectional", causal=True),
                                     dict(rotate="q", causal=True, layout="zigzag"),
                                     dict(mode="double_ring", node_size=1, causal=True)])
@pytest.mark.parametrize("per_rank", [1, 5])
def test_ring_on_torch_matches_the_reference(comm, monkeypatch, dtype, options, per_rank):
    """Forward and backward through the ring with the torch backend against the float64 reference, GQA; K/V
    travel as torch's op takes them (``buffers.PlainBuffers``), in every mode that passes them; the backward's
    causal triangles in halves down to 2 rows (``torch_kernel.TRIANGLE_ROWS``)."""
    monkeypatch.setattr(torch_kernel, "TRIANGLE_ROWS", 2)
    P = comm.size
    S = per_rank * P + (P > 1)  # uneven shards beyond one rank
    rng = np.random.default_rng(7)
    Q, K, V = qkv(rng, (1, 4, S, 8), (1, 2, S, 8), dtype)
    dOut = rng.standard_normal(Q.shape).astype(dtype)
    layout = options.get("layout", "contiguous")
    idx = shard_indices(S, P, comm.rank, layout)
    mine = [np.ascontiguousarray(x[..., idx, :]) for x in (Q, K, V, dOut)]
    pos = np.arange(S)
    klo, khi = visible_keys(pos, pos, causal=options.get("causal", False), window=options.get("window", (-1, -1)))
    x64 = [x.astype(np.float64) for x in (Q, K, V)]
    ref, _ = reference_attention(*x64, None, klo, khi)
    want = reference_attention_backward(dOut.astype(np.float64), *x64, None, klo, khi)
    before = backends.calls["torch"]
    with backends.using("torch"):
        out, lse = ring_attention(*mine[:3], comm, **options)
        grads = ring_attention_backward(mine[3], *mine[:3], out, lse, comm, **options)
    assert backends.calls["torch"] > before
    np.testing.assert_allclose(out, ref[..., idx, :], atol=tol(dtype), rtol=0)
    for got, full in zip(grads, want):
        np.testing.assert_allclose(got, full[..., idx, :], atol=GRAD_TOL[dtype], rtol=0)


@pytest.mark.mpi
@pytest.mark.ranks(1, 2)  # a rule per block: P = 2 shows every rank follows it (the torch ring at P = 1..4: above)
@needs_torch
@pytest.mark.parametrize("vectorized", [True, False])
def test_auto_ring_gives_torch_the_blocks_of_many_rows(comm, monkeypatch, vectorized):
    """With no backend chosen, a ring call whose float32 blocks reach ``AUTO_ROWS`` computes them on torch's op,
    forward and backward, on every rank, a call of one row fewer on the NumPy kernel; both within the float32
    tolerance, and the same bits when called again."""
    monkeypatch.setattr(backends, "numpy_exp2_vectorized", lambda: vectorized)
    rules = backends.AUTO_ROWS[vectorized]
    P = comm.size
    for n, name in ((max(rules[("float32", "forward")], rules[("float32", "backward")]), "torch"),
                    (min(rules[("float32", "forward")], rules[("float32", "backward")]) - 1, "numpy")):
        S = n * P
        rng = np.random.default_rng(S)
        Q, K, V, dOut = (rng.standard_normal((1, 1, S, 8)).astype(np.float32) for _ in range(4))
        idx = shard_indices(S, P, comm.rank)
        mine = [np.ascontiguousarray(x[..., idx, :]) for x in (Q, K, V, dOut)]
        before = dict(backends.calls)
        with backends.using("auto"):
            runs = [ring_attention(*mine[:3], comm, causal=True) for _ in range(2)]
            grads = [ring_attention_backward(mine[3], *mine[:3], *runs[0], comm, causal=True) for _ in range(2)]
        assert backends.calls[name] > before.get(name, 0)
        other = "numpy" if name == "torch" else "torch"
        assert backends.calls[other] == before.get(other, 0), f"{other} computed a block of {n} rows"
        for a, b in zip(runs[0] + grads[0], runs[1] + grads[1]):
            np.testing.assert_array_equal(a, b)
        x64 = [x.astype(np.float64) for x in (Q, K, V)]
        pos = np.arange(S)
        klo, khi = visible_keys(pos, pos, causal=True)
        ref, _ = reference_attention(*x64, None, klo, khi)
        want = reference_attention_backward(dOut.astype(np.float64), *x64, None, klo, khi)
        np.testing.assert_allclose(runs[0][0], ref[..., idx, :], atol=tol(np.float32), rtol=0)
        for got, full in zip(grads[0], want):
            np.testing.assert_allclose(got, full[..., idx, :], atol=GRAD_TOL[np.float32], rtol=0)


@pytest.mark.mpi
@needs_torch
def test_delta_is_checked_once_per_backward_call(comm, monkeypatch):
    """On the torch backend a backward call whose delta the call computed itself as rowsum(dout * out)
    (``block.Rowsum``) does not check it; with a ``dlse`` (delta - dlse) it checks once, not once per block or
    key chunk, and every block goes to the NumPy kernel: the bits of the NumPy backend's call."""
    P, S = comm.size, 12 * comm.size + 1
    rng = np.random.default_rng(3)
    Q, K, V, dOut = (rng.standard_normal((1, 2, S, 8)) for _ in range(4))
    G = rng.standard_normal(Q.shape[:-1])
    idx = shard_indices(S, P, comm.rank, "zigzag")
    q, k, v, dout = (np.ascontiguousarray(x[..., idx, :]) for x in (Q, K, V, dOut))
    g = np.ascontiguousarray(G[..., idx])
    checks = []
    real = torch_kernel.delta_matches
    monkeypatch.setattr(torch_kernel, "delta_matches", lambda *a: checks.append(1) or real(*a))
    with Ring(comm, S, causal=True, layout="zigzag") as ring, backends.using("torch"):
        out, lse = ring.forward(q, k, v)
        before = backends.calls["torch"]
        ring.backward(dout, q, k, v, out, lse)
        assert not checks and backends.calls["torch"] - before >= P  # every block (and chunk) on torch
        before = backends.calls["torch"]
        with_dlse = ring.backward(dout, q, k, v, out, lse, dlse=g)
        assert len(checks) == 1 and backends.calls["torch"] == before
    with Ring(comm, S, causal=True, layout="zigzag") as ring, backends.using("numpy"):
        for a, b in zip(with_dlse, ring.backward(dout, q, k, v, out, lse, dlse=g)):
            np.testing.assert_array_equal(a, b)


@needs_torch
def test_torch_ops_take_row_slices_without_copies():
    """A piece's rows of a rank's array go to the ops as a view of its memory; an array whose last axis is not
    contiguous is copied."""
    torch = torch_kernel._torch()
    x = np.arange(2 * 3 * 10 * 4, dtype=np.float32).reshape(2, 3, 10, 4)
    rows = x[:, :, 2:7]
    t = torch_kernel._tensor(torch, rows)
    assert t.data_ptr() == rows.__array_interface__["data"][0] and np.array_equal(t.numpy(), rows)
    cols = x[..., ::2]
    t = torch_kernel._tensor(torch, cols)
    assert t.is_contiguous() and np.array_equal(t.numpy(), cols)


@needs_torch
@pytest.mark.parametrize("kind", ["full", "offset causal", "window"])
def test_torch_backward_overwrites_its_buffers(kind):
    """The torch backend's backward writes every gradient into the kept buffers it is given, whether one op call
    or several compute the piece: buffers holding NaN give the bits of a call without buffers."""
    sq, sk = 24, 40
    rng = np.random.default_rng(5)
    q, k, v, dout = (rng.standard_normal((1, 2, n, 8)).astype(np.float32) for n in (sq, sk, sk, sq))
    klo, khi = _mask(kind, sq, sk)
    out, lse = torch_kernel.forward(q, k, v, None, klo, khi)
    plain = torch_kernel.backward(dout, q, k, v, out, lse, None, klo, khi)
    buffers = [np.full(a.shape, np.nan, np.float32) for a in (q, k, v)]
    kept = torch_kernel.backward(dout, q, k, v, out, lse, None, klo, khi, buffers=buffers)
    for got, want, buf in zip(kept, plain, buffers):
        assert np.shares_memory(got, buf)
        np.testing.assert_array_equal(got, want)


def test_rowsum_mark_survives_views_only():
    """``block.Rowsum``: slices and reshapes of a marked delta keep the mark (``queries`` then skips the check),
    values computed from it do not (delta - dlse is checked again)."""
    from mpiring.core.block import Rowsum, queries

    delta = np.arange(24.0).reshape(2, 12).view(Rowsum)
    assert isinstance(delta[..., 3:7], Rowsum) and isinstance(delta.reshape(24), Rowsum)
    assert not isinstance(delta - 1.0, Rowsum) and not isinstance(np.exp(delta), Rowsum)
    assert not isinstance(delta.sum(), Rowsum)
    dout = out = np.zeros((2, 12, 4))
    assert queries(dout, dout, out, delta[:, 0], delta).rowsum is True


def test_progress_polls_while_a_long_call_runs():
    """``Progress.during``: a helper thread polls while a call that releases the GIL runs, and an error the
    poll raised is raised after the call; without the helper, one poll after the call."""
    import time

    from mpiring.core.tiles import THREAD_POLL_INTERVAL, Progress

    polls = []
    tick = Progress(lambda: polls.append(time.perf_counter()))
    assert tick.threaded
    start = time.perf_counter()
    assert tick.during(lambda: time.sleep(40 * THREAD_POLL_INTERVAL) or "done") == "done"
    during = [t for t in polls if t < start + 40 * THREAD_POLL_INTERVAL]
    assert len(during) >= 10  # (time.sleep releases the GIL, as torch's ops do)

    def fails():
        raise RuntimeError("a peer failed")

    with pytest.raises(RuntimeError, match="a peer failed"):
        Progress(fails).during(lambda: time.sleep(10 * THREAD_POLL_INTERVAL))
    polls.clear()
    tick.threaded = False  # an MPI below MPI_THREAD_SERIALIZED: polls between calls only
    tick.last = 0
    tick.during(lambda: time.sleep(10 * THREAD_POLL_INTERVAL))
    assert len(polls) == 1


def test_no_helper_polls_once_during_has_returned():
    """The helper is neither waited for nor joined (docs/performance.md §24), yet once ``during`` returns it
    never calls the progress function again: the caller may call MPI itself from then on."""
    import threading
    import time

    from mpiring.core.tiles import THREAD_POLL_INTERVAL, Progress

    helper_polls = []

    def poll():
        if threading.current_thread() is not threading.main_thread():
            helper_polls.append(time.perf_counter())

    tick = Progress(poll)
    for _ in range(12):
        tick.during(lambda: time.sleep(2.5 * THREAD_POLL_INTERVAL))
        returned, polled = time.perf_counter(), len(helper_polls)
        time.sleep(3 * THREAD_POLL_INTERVAL)
        assert len(helper_polls) == polled and max(helper_polls) < returned
    assert len(helper_polls) >= 12  # the helpers did poll meanwhile


def test_no_helper_polls_after_they_are_stopped(monkeypatch):
    """Ctrl-C's handler stops the helper threads before it finalizes MPI: once ``stop_helper_polls``
    returns, the helper of a call still running never calls the progress function again (a poll after
    MPI_Finalize ends the rank with MPI's error, exit 1, instead of 130)."""
    import threading
    import time

    from mpiring.core import tiles

    monkeypatch.setattr(tiles, "_HELPERS_STOPPED", threading.Event())
    polls, stopped_at = [], []

    def call():  # releases the GIL like a torch op; "Ctrl-C" arrives in the middle of it
        time.sleep(10 * tiles.THREAD_POLL_INTERVAL)
        tiles.stop_helper_polls()
        stopped_at.append(time.perf_counter())
        time.sleep(10 * tiles.THREAD_POLL_INTERVAL)

    def poll():
        if threading.current_thread() is not threading.main_thread():  # (during polls once more after it)
            polls.append(time.perf_counter())

    tiles.Progress(poll).during(call)
    assert polls and polls[0] < stopped_at[0]  # it polled before
    assert max(polls) <= stopped_at[0], "a helper polled after stop_helper_polls returned"


@needs_torch
def test_blocks_are_kept_in_the_form_of_the_backend(rng):
    """The ring keeps K/V as [x | 1]^T for the NumPy kernel and as given for torch's op (no copy per block)."""
    from mpiring.core.buffers import KVBuffers, PlainBuffers, kernel_form

    k, v = rng.standard_normal((2, 2, 5, 4)), rng.standard_normal((2, 2, 5, 3))
    with backends.using("numpy"):
        slots = kernel_form((k, v), 5)
        kt, vt = slots.hold((k, v))
        assert isinstance(slots, KVBuffers) and slots.padded and slots.pad == 1
        np.testing.assert_array_equal(np.swapaxes(kt[..., :-1, :], -1, -2), k)
    with backends.using("torch"):
        slots = kernel_form((k, v), 5)
        held = slots.hold((k, v))
        assert isinstance(slots, PlainBuffers) and not slots.padded and slots.pad == 0
        assert all(np.shares_memory(a, b) for a, b in zip(held, (k, v)))
        assert [x.shape for x in slots.take(3)] == [(2, 2, 3, 4), (2, 2, 3, 3)]


@pytest.mark.parametrize("rows", [None, 1, 2, 3, 7, 128])
def test_a_triangle_in_halves_covers_each_visible_pair_once(rows):
    """``torch_kernel._triangle``'s calls (rows a:e, row a+i seeing keys c..c+i clipped at d), every size,
    offset and clipping: each visible pair in exactly one call, nothing else; unclipped triangles of more than
    ``rows`` rows come in several calls."""
    from mpiring.core.tuning import torch_kernel

    cases = [(size, c, c + m) for size in range(1, 41) for c in (0, 5) for m in (size, size - 1, 1, size + 3)]
    for n, c, d in [case for case in cases if case[2] > case[1]]:
        want = np.zeros((n, d), int)
        for i in range(n):
            want[i, c:min(c + i + 1, d)] = 1
        got = np.zeros((n, d), int)
        calls = list(torch_kernel._triangle(0, n, c, d, rows))
        for a, e, lo, hi, causal, mask, dead in calls:
            assert mask is None and dead is None and 0 <= a < e <= n and c <= lo < hi <= d
            cols = np.arange(lo, hi)
            got[a:e, lo:hi] += (cols[None, :] - lo <= np.arange(e - a)[:, None]) if causal else 1
        np.testing.assert_array_equal(got, want, err_msg=f"n={n} c={c} d={d}")
        assert (len(calls) > 1) == (rows is not None and n > rows and c + n <= d)


@needs_torch
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("kind", ["causal", "offset causal"])
@pytest.mark.parametrize("sq,sk", [(33, 33), (17, 40), (50, 23)])
def test_the_backward_of_triangles_in_halves_is_the_reference(rng, monkeypatch, rows, kind, sq, sk):
    """The torch backward with triangles in halves (``TRIANGLE_ROWS``): more op calls than in one piece, and
    the gradients of the float64 and float32 references within tolerance."""
    from mpiring.core.tuning import torch_kernel

    klo, khi = _mask(kind, sq, sk)
    for dtype in (np.float64, np.float32):
        q, k, v = (x.astype(dtype) for x in qkv(rng, (2, 4, sq, 8), (2, 2, sk, 8)))
        dout = rng.standard_normal(q.shape).astype(dtype)
        x64 = [x.astype(np.float64) for x in (dout, q, k, v)]
        out, lse = reference_attention(*x64[1:], None, klo, khi)
        want = reference_attention_backward(*x64, None, klo, khi)
        counts = []
        for split in (None, rows):
            monkeypatch.setattr(torch_kernel, "TRIANGLE_ROWS", split)
            before = backends.calls["torch"]
            with backends.using("torch"):
                got = backends.attention_block_backward(dout, q, k, v, out.astype(dtype), lse.astype(dtype),
                                                        None, klo, khi)
            counts.append(backends.calls["torch"] - before)
            for g, w in zip(got, want):
                np.testing.assert_allclose(g, w, atol=GRAD_TOL[np.dtype(dtype).type], rtol=0)
        assert counts == [1, 1]  # one block each (the op calls are counted below)
    plain, halves = (list(torch_kernel._calls(klo, khi, sq, sk, 1 << 20, split)) for split in (None, rows))
    splits = any(c[4] and c[1] - c[0] > rows and c[2] + c[1] - c[0] <= c[3] for c in plain)  # a triangle to split
    assert (len(halves) > len(plain)) == splits and (splits or sq > sk)


@needs_torch
@pytest.mark.parametrize("threaded", [True, False])
@pytest.mark.parametrize("kind", ["full", "causal", "offset causal", "window", "documents"])
@pytest.mark.parametrize("sq,sk", [(15, 15), (17, 40), (50, 23), (64, 64)])
def test_torch_in_many_calls_stores_then_merges(rng, monkeypatch, threaded, kind, sq, sk):
    """Calls of 16 rows (the smallest), polled from a helper thread or between calls: the first call of each
    row chunk stores its (out, lse) into empty rows, the next ones (a triangle after a chunk's full part)
    merge; and the same block merged into an accumulator that already holds another block. Forward and
    backward against the float64 reference."""
    from mpiring.core.tuning import torch_kernel

    monkeypatch.setattr(torch_kernel, "CALL_SCORES", 1)
    monkeypatch.setattr(torch_kernel, "SHORT_CALL_SCORES", 1)
    q, k, v = qkv(rng, (2, 4, sq, 8), (2, 2, sk, 8))
    _, k0, v0 = qkv(rng, (2, 4, sq, 8), (2, 2, 9, 8))  # another block of 9 keys, all visible
    dout = rng.standard_normal(q.shape)
    klo, khi = _mask(kind, sq, sk)
    want, want_lse = reference_attention(q, k, v, None, klo, khi)
    first, first_lse = reference_attention(q, k0, v0)
    both_lse = np.logaddexp(first_lse, want_lse)  # the two blocks merged, from the definition
    both = (np.exp(first_lse - both_lse)[..., None] * first
            + np.exp(np.where(np.isneginf(want_lse), -np.inf, want_lse - both_lse))[..., None] * want)
    polls = []
    progress = (lambda: polls.append(1)) if threaded else None
    with backends.using("torch"):
        alone, alone_lse = _computed_by("torch", lambda: backends.attention_block(q, k, v, None, klo, khi,
                                                                                   run=BlockRun(progress=progress)))
        acc = (np.zeros(q.shape), np.full(q.shape[:-1], -np.inf))
        backends.attention_block(q, k0, v0, None, into=acc)
        backends.attention_block(q, k, v, None, klo, khi, into=acc, run=BlockRun(progress=progress))
        grads = backends.attention_block_backward(dout, q, k, v, want, want_lse, None, klo, khi,
                                                  run=BlockRun(progress=progress))
    assert_attention_close(alone, want, np.float64)
    np.testing.assert_allclose(alone_lse, want_lse, atol=1e-12, rtol=0)
    assert_attention_close(acc[0], both, np.float64)
    np.testing.assert_allclose(acc[1], both_lse, atol=1e-12, rtol=0)
    for got, ref_g, name in zip(grads, reference_attention_backward(dout, q, k, v, None, klo, khi),
                                ("dq", "dk", "dv")):
        assert_attention_close(got, ref_g, np.float64, name)
