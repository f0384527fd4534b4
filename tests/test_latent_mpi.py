"""Multi-head latent attention under context parallelism (``mpiring.mla_attention``): the latent travels.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_latent_mpi.py

Every strategy that moves K/V blocks, every layout and mask kind, from one
token per rank to uneven shards: each rank's out, lse, dq, dc_kv, dk_rope and
the summed dW_UK, dW_UV against the float64 reference of the expanded heads
(``testing.latent_reference``); the bytes each rank sends equal the cost
model's for a K/V pair of one head of widths r and dr, forward and backward;
the ratio to per-head K/V measured by running the same plan on the expanded
heads; half inputs and coded wires within the tolerance table; the strategies
that move heads or queries, and weights that differ between ranks, refused on
every rank; decoding in the absorbed form over a cache holding the latent.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpiring import (
    LAYOUTS,
    KVCache,
    Record,
    mla_attention,
    mla_attention_backward,
    ring_attention,
    shard_indices,
)
from mpiring.core.mla import absorbed, expand, latent_keys, unabsorbed
from mpiring.core.precision import named_dtype
from mpiring.cost.nodes import predicted_bytes
from mpiring.testing import (
    attention_error,
    latent_reference,
    latent_reference_backward,
    reference,
    tolerance,
)

pytestmark = pytest.mark.mpi

H, DN, DR, DV, R = 4, 8, 4, 6, 12
MASKS = {"full": {}, "causal": dict(causal=True), "window": dict(causal=True, window=(3, 0)),
         "documents": dict(causal=True, cu_seqlens="docs")}
STRATEGIES = {"ring": dict(mode="ring"), "bidirectional": dict(mode="bidirectional"),
              "allgather": dict(mode="allgather"), "sparse": dict(mode="sparse"),
              "double_ring n=1": dict(mode="double_ring", node_size=1)}


def _mla(S, seed=0, batch=2, dtype=np.float64):
    """Whole q, c_kv, k_rope, dout (batch 2) and the weights, from one seed: the same on every rank."""
    rng = np.random.default_rng([seed, S])
    q, c, kr, dout = (rng.standard_normal((batch, h, S, d)) for h, d in ((H, DN + DR), (1, R), (1, DR), (H, DV)))
    wk, wv = rng.standard_normal((H, R, DN)) / 3, rng.standard_normal((H, R, DV)) / 3
    return [a.astype(dtype) for a in (q, c, kr, dout)] + [wk, wv]


def _options(strategy, mask, layout, S):
    options = dict(STRATEGIES[strategy], **MASKS[mask], layout=layout)
    if options.get("cu_seqlens") == "docs":
        options["cu_seqlens"] = [0, 2, 2, S - 4, S] if S >= 6 else [0, S]
    return options


def _check(comm, S, options, seed=0):
    """One forward and backward on every rank against the reference; returns the two Records."""
    Q, C, KR, dO, WK, WV = _mla(S, seed)
    rows = shard_indices(S, comm.size, comm.rank, options.get("layout", "contiguous"))
    q, c, kr, do = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, C, KR, dO))
    mask = {k: v for k, v in options.items() if k in ("causal", "window", "cu_seqlens")}
    fwd, bwd = Record(), Record()
    out, lse = mla_attention(q, c, kr, WK, WV, comm, record=fwd, **options)
    want = latent_reference(Q, C, KR, WK, WV, **mask)
    np.testing.assert_allclose(out, want[0][..., rows, :], atol=1e-12, rtol=0)
    np.testing.assert_allclose(lse, want[1][..., rows], atol=1e-12, rtol=0)
    grads = mla_attention_backward(do, q, c, kr, WK, WV, out, lse, comm, record=bwd, **options)
    wants = latent_reference_backward(dO, Q, C, KR, WK, WV, **mask)
    for name, got, ref in zip(("dq", "dc_kv", "dk_rope", "dw_uk", "dw_uv"), grads, wants):
        ref = ref if name.startswith("dw") else ref[..., rows, :]
        assert got.shape == ref.shape and got.dtype == np.float64, name
        assert attention_error(got, ref, "d" + name)[0] <= 1e-12, (name, options, S)
    return fwd, bwd, (q, c, kr, do, out, lse, WK, WV)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_strategy_matches_the_reference_and_sends_the_latent(comm, strategy, mask, layout):
    P = comm.size
    for S in sorted({P, 2 * P + 1, 5 * P + 3}):
        options = _options(strategy, mask, layout, S)
        fwd, bwd, arrays = _check(comm, S, options)
        # bytes: the cost model's for one K/V head of widths r (c_kv) and dr (k_rope), float64
        latent_shape = dict(batch=2, hq=H, hk=1, dim=R, dim_v=DR, itemsize=8)
        assert fwd.bytes_sent == predicted_bytes(fwd.plan, **latent_shape)[comm.rank], (options, S)
        weights = 2 * (P - 1) * H * R * (DN + DV) * 8 // P if P > 1 else 0  # the weights' all-reduce, ring
        assert bwd.bytes_sent == predicted_bytes(fwd.plan, **latent_shape, backward=True)[comm.rank] + weights
        assert fwd.wire_dtype == "latent (float64)"


def test_local_weight_gradients_sum_to_the_whole(comm):
    """``sum_weights=False``: each rank's share; their sum over the ranks is the reference's, and nothing more moved."""
    S = 4 * comm.size + 1
    fwd, _, (q, c, kr, do, out, lse, WK, WV) = _check(comm, S, dict(causal=True, layout="zigzag"))
    rec = Record()
    grads = mla_attention_backward(do, q, c, kr, WK, WV, out, lse, comm, causal=True, layout="zigzag",
                                   sum_weights=False, record=rec)
    Q, C, KR, dO, _, _ = _mla(S)
    wants = latent_reference_backward(dO, Q, C, KR, WK, WV, causal=True)
    for got, want in zip(grads[3:], wants[3:]):
        np.testing.assert_allclose(comm.allreduce(got, op=MPI.SUM), want, atol=1e-12, rtol=0)
    shape = dict(batch=2, hq=H, hk=1, dim=R, dim_v=DR, itemsize=8, backward=True)
    assert rec.bytes_sent == predicted_bytes(fwd.plan, **shape)[comm.rank]


@pytest.mark.parametrize("mode", ["ring", "allgather"])
def test_the_latent_against_per_head_kv_bytes(comm, mode):
    """The same plan with per-head K and V: bytes per token H (d_nope + dr + dv) against r + dr, measured."""
    if comm.size == 1:
        pytest.skip("nothing moves on one rank")
    S = 6 * comm.size
    Q, C, KR, _, WK, WV = _mla(S)
    rows = shard_indices(S, comm.size, comm.rank, "zigzag")
    latent_rec, heads_rec = Record(), Record()
    mla_attention(*(x[..., rows, :] for x in (Q, C, KR)), WK, WV, comm, causal=True, layout="zigzag", mode=mode,
                  record=latent_rec)
    K, V = expand(C, KR, WK, WV)
    ring_attention(*(np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V)), comm, causal=True, layout="zigzag",
                   mode=mode, record=heads_rec)
    assert latent_rec.bytes_sent * H * (DN + DR + DV) == heads_rec.bytes_sent * (R + DR)


@pytest.mark.parametrize("dtype,wire", [("float32", None), ("float16", None), ("bfloat16", None),
                                        ("float32", "bfloat16"), ("float32", "int8"), ("float64", "float16")])
def test_half_inputs_and_coded_wires_within_the_tolerance(comm, dtype, wire):
    try:
        kind = named_dtype(dtype)
    except ValueError as exc:
        pytest.skip(str(exc))
    S = 5 * comm.size + 2
    Q, C, KR, dO, WK, WV = _mla(S, seed=5, dtype=kind)
    rows = shard_indices(S, comm.size, comm.rank, "striped")
    q, c, kr, do = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, C, KR, dO))
    options = dict(causal=True, layout="striped", wire_dtype=wire)
    out, lse = mla_attention(q, c, kr, WK, WV, comm, **options)
    grads = mla_attention_backward(do, q, c, kr, WK, WV, out, lse, comm, **options)
    f64 = [x.astype(np.float64) for x in (Q, C, KR, dO)]
    want = latent_reference(*f64[:3], WK, WV, causal=True)
    wants = latent_reference_backward(f64[3], *f64[:3], WK, WV, causal=True)
    assert out.dtype == kind and grads[1].dtype == kind
    tol = tolerance(kind, wire)
    assert attention_error(out, want[0][..., rows, :])[0] <= tol
    for name, got, ref in zip(("dq", "dc", "dkr", "dwk", "dwv"), grads, wants):
        ref = ref if name.startswith("dw") else ref[..., rows, :]
        assert attention_error(got, ref, name)[0] <= 4 * tol, name  # as run --backward accepts (verify.py)


@pytest.mark.parametrize("options,message", [
    (dict(mode="ulysses"), "mode='ulysses' moves heads, not K/V blocks"),
    (dict(rotate="q"), "moves the latent K/V, not queries"),
    (dict(mode="ring", ulysses_size=1), "takes only .* also sets ulysses_size"),
    (dict(softcap=2.0), "takes only"),
])
def test_strategies_that_move_heads_or_queries_are_refused(comm, options, message):
    from mpiring.plans.spec import Spec

    S = 3 * comm.size
    Q, C, KR, _, WK, WV = _mla(S)
    rows = shard_indices(S, comm.size, comm.rank)
    rec = Record()
    with pytest.raises(ValueError, match=message):
        mla_attention(*(x[..., rows, :] for x in (Q, C, KR)), WK, WV, comm, spec=Spec.of(**options), record=rec)
    assert rec.bytes_sent == 0 and not rec.events


def test_weights_that_differ_or_shapes_that_do_not_fit_raise_on_every_rank(comm):
    S = 3 * comm.size
    Q, C, KR, _, WK, WV = _mla(S)
    rows = shard_indices(S, comm.size, comm.rank)
    q, c, kr = (x[..., rows, :] for x in (Q, C, KR))
    other = WK + (comm.rank == comm.size - 1)
    if comm.size > 1:
        with pytest.raises(ValueError, match="w_uk, w_uv"):
            mla_attention(q, c, kr, other, WV, comm)
    bad = WV[:, :-1] if comm.rank == 0 else WV
    with pytest.raises(ValueError, match="w_uk and w_uv must be"):
        mla_attention(q, c, kr, WK, bad, comm)
    with pytest.raises(ValueError, match="one latent per token"):
        mla_attention(q, np.concatenate([c, c], axis=-3), kr, WK, WV, comm)


@pytest.mark.parametrize("placement", ["round_robin", "contiguous"])
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_decoding_in_the_absorbed_form_over_a_latent_cache(comm, placement, quantize):
    """The cache holds [k_rope | c] once per token, sharded; every rank gets the per-head reference's result."""
    S, T = 7 * comm.size + 3, 3
    Q, C, KR, _, WK, WV = _mla(S + T, seed=9, batch=1)
    keys = latent_keys(C, KR)
    cache = KVCache(comm, 1, DR + R, value_dim=R, dtype=np.float64, shared_values=True, placement=placement,
                    quantize=quantize)
    cache.extend(keys[..., :S, :])
    cache.extend(keys[..., S:, :])  # the new tokens join the cache, then attend causally
    scale = (DN + DR) ** -0.5
    out, lse = cache.attend(absorbed(Q[..., S:, :], WK), scale=scale, causal=True)
    out = unabsorbed(out, WV)
    K, V = expand(C, KR, WK, WV)
    want, want_lse = reference(Q[..., S:, :], K, V, causal=True, q_positions=np.arange(S, S + T))
    tol = 1e-12 if quantize is None else 4e-2
    assert attention_error(out, want)[0] <= tol and attention_error(lse, want_lse)[0] <= tol
    assert len({o.tobytes() for o in comm.allgather(out)}) == 1  # the same bits on every rank
    per_token = (DR + R + 1) * 8 if quantize is None else DR + R + 4  # [k | 1]^T in float64, or int8 and a scale
    assert comm.allreduce(cache.nbytes) == (S + T) * per_token
    with pytest.raises(ValueError, match="shared_values"):
        cache.extend(keys[..., :1, :], keys[..., :1, :R] + 1)
