"""Any mask, any score, under every strategy: the mask algebra, softcap, bias, sinks, dropout and the max logit
against the dense float64 reference (``core.reference.scored_attention``, itself checked against torch), forward
and backward, on however many ranks the test runs (run/test: 1 to 4).

Shards come from ``mpiring.shard_indices``; the inputs are drawn whole from one seed on every rank, then sliced.
"""

import numpy as np
import pytest

import mpiring
import mpiring.testing
from mpiring import masks
from mpiring.core.reference import definition_mask, scored_attention

pytestmark = pytest.mark.mpi

B, H, HK, D = 2, 4, 2, 8


def _comm():
    from mpi4py import MPI
    return MPI.COMM_WORLD


def _arrays(S, seed=0):
    rng = np.random.default_rng(seed)
    q, dout = rng.standard_normal((B, H, S, D)), rng.standard_normal((B, H, S, D))
    k, v = rng.standard_normal((B, HK, S, D)), rng.standard_normal((B, HK, S, D))
    return q, k, v, dout, rng.standard_normal(H)


def _allowed(S, opts):
    """The mask from the definitions: the options' and each piece's ``allows``, batch axes in front."""
    pos = np.arange(S)
    ok = definition_mask(pos, pos, causal=opts.get("causal", False), window=opts.get("window"),
                         cu_seqlens=opts.get("cu_seqlens"))[None, None]
    piece = opts.get("mask")
    if piece is not None:
        extra = piece.allows(pos[:, None], pos[None, :])
        ok = ok & (extra[:, None] if extra.ndim == 3 else extra)
    return ok


CASES = {
    "prefix LM": lambda sinks: dict(mask=masks.causal() | masks.prefix(9)),
    "prefix alone": lambda sinks: dict(mask=masks.prefix(9)),
    "function": lambda sinks: dict(mask=masks.function(lambda q, k: ((q + k) % 3 == 0) | (k == 0))),
    "padding": lambda sinks: dict(mask=masks.padding(np.array([20, 37])), causal=True),
    "window | global": lambda sinks: dict(mask=masks.window(4, 0) | masks.function(lambda q, k: k < 3)),
    "softcap": lambda sinks: dict(softcap=1.5, causal=True),
    "alibi": lambda sinks: dict(bias=masks.alibi(H), causal=True),
    "sinks": lambda sinks: dict(sinks=sinks, window=(5, 0)),
    "dropout": lambda sinks: dict(dropout=0.3, seed=7, causal=True),
    "everything": lambda sinks: dict(mask=masks.window(6, 2) | masks.prefix(4), softcap=2.0, bias=masks.alibi(H),
                                     sinks=sinks, dropout=0.2, seed=1, cu_seqlens=np.array([0, 30, 37])),
}
STRATEGIES = {"ring": {}, "bidirectional": dict(mode="bidirectional"), "allgather": dict(mode="allgather"),
              "pass-q": dict(rotate="q"), "ulysses": dict(mode="ulysses"), "double_ring": dict(mode="double_ring"),
              "grid": dict(ulysses_size=2), "sparse": dict(mode="sparse")}


LAYOUTS = ["contiguous", "zigzag", "striped"]


def _applies(strategy, P, layout, S):
    if strategy == "ulysses" and H % P:
        return False
    if strategy == "grid" and P % 2:
        return False
    return not (layout != "contiguous" and S < 2 * P)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_masks_and_scores_match_the_reference(case, strategy):
    comm = _comm()
    P, r, S = comm.Get_size(), comm.Get_rank(), 37
    q, k, v, dout, sinks = _arrays(S)
    opts = CASES[case](sinks)
    scores = {n: opts[n] for n in ("softcap", "bias", "sinks", "dropout", "seed") if n in opts}
    allowed = _allowed(S, opts)
    want_out, want_lse, want_max = scored_attention(q, k, v, allowed, **scores)
    want = scored_attention(q, k, v, allowed, dout=dout, **scores)
    tol = 1e-12 if case == "dropout" else 1e-10
    # two of the three layouts per case and strategy, turning with both: every pair of the three axes meets
    turn = (list(CASES).index(case) + list(STRATEGIES).index(strategy)) % 3
    for layout in LAYOUTS[turn:] + LAYOUTS[:turn - 1] if turn else LAYOUTS[:2]:
        if not _applies(strategy, P, layout, S):
            continue
        i = mpiring.shard_indices(S, P, r, layout)
        kw = dict(opts, layout=layout, **STRATEGIES[strategy])
        out, lse, top = mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, return_max_logit=True,
                                               **kw)
        grads = mpiring.ring_attention_backward(dout[..., i, :], q[..., i, :], k[..., i, :], v[..., i, :], out, lse,
                                                comm, **kw)
        where = f"{case}, {strategy}, {layout}, P={P}"
        np.testing.assert_allclose(out, want_out[..., i, :], atol=tol, rtol=0, err_msg=where)
        np.testing.assert_allclose(lse, want_lse[..., i], atol=tol, rtol=0, err_msg=where)
        np.testing.assert_allclose(top, want_max, atol=tol, rtol=0, err_msg=where)
        assert len(grads) == (4 if "sinks" in opts else 3), where
        for name, got, ref in zip(("dq", "dk", "dv"), grads, want):
            np.testing.assert_allclose(got, ref[..., i, :], atol=tol, rtol=0, err_msg=f"{name}: {where}")
        if "sinks" in opts:
            np.testing.assert_allclose(grads[3], want[3], atol=tol, rtol=0, err_msg=f"dsinks: {where}")


@pytest.mark.parametrize("n", [1, 2, 5, 16])
def test_tokens_per_rank_from_one_with_holes(n):
    """A mask with holes at every shard length from 1 token up, uneven lengths, positions given directly."""
    comm = _comm()
    P, r = comm.Get_size(), comm.Get_rank()
    S = n * P + (P - 1)  # uneven: the first ranks hold one more
    q, k, v, dout, _ = _arrays(S, seed=n)
    mine = np.arange(S)[np.arange(S) % P == r]  # striped by hand: the public positions= path
    mask = masks.function(lambda a, b: (b <= a) & ((a - b) % 2 == 0)) | masks.prefix(2)
    allowed = _allowed(S, dict(mask=mask))
    want_out, want_lse, _ = scored_attention(q, k, v, allowed, softcap=3.0)
    want = scored_attention(q, k, v, allowed, softcap=3.0, dout=dout)
    out, lse = mpiring.ring_attention(q[..., mine, :], k[..., mine, :], v[..., mine, :], comm, positions=mine,
                                      mask=mask, softcap=3.0)
    grads = mpiring.ring_attention_backward(dout[..., mine, :], q[..., mine, :], k[..., mine, :], v[..., mine, :],
                                            out, lse, comm, positions=mine, mask=mask, softcap=3.0)
    np.testing.assert_allclose(out, want_out[..., mine, :], atol=1e-10, rtol=0)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(got, ref[..., mine, :], atol=1e-10, rtol=0)


def test_the_ring_skips_the_blocks_a_function_mask_hides():
    """Block sparsity of a mask with holes comes from its definition: a rank computes no pair it hides."""
    comm = _comm()
    P, r, S = comm.Get_size(), comm.Get_rank(), 8 * comm.Get_size()
    q, k, v, _, _ = _arrays(S)
    mask = masks.function(lambda a, b: (a // 8) == (b // 8))  # each rank's own 8 tokens only: documents by rule
    rec = mpiring.Record(r)
    i = mpiring.shard_indices(S, P, r)
    mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, mask=mask, record=rec)
    assert rec.computed_pairs == 64 and rec.visible_pairs == 64
    assert all(task.kind == "skip" for step, task in rec.tasks if task.source != r)
    if P > 1:
        assert rec.bytes_sent == 0, "no rank needs another's block: the ring stops before the first transfer"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_single_and_half_precision_scores_within_the_table(dtype):
    from mpiring.core.precision import named_dtype
    try:
        kind = named_dtype(dtype)
    except ValueError as exc:
        pytest.skip(str(exc))
    comm = _comm()
    P, r, S = comm.Get_size(), comm.Get_rank(), 29
    q, k, v, dout, sinks = _arrays(S, seed=3)
    opts = dict(mask=masks.causal() | masks.prefix(5), softcap=2.0, sinks=sinks, bias=masks.alibi(H))
    scores = {n: opts[n] for n in ("softcap", "bias", "sinks")}
    want_out = scored_attention(q, k, v, _allowed(S, opts), **scores)[0]
    i = mpiring.shard_indices(S, P, r)
    f = [a[..., i, :].astype(kind) for a in (q, k, v)]
    out, _ = mpiring.ring_attention(*f, comm, **opts)
    assert out.dtype == kind
    tol = mpiring.testing.tolerance(kind)
    np.testing.assert_allclose(out.astype(np.float64), want_out[..., i, :], atol=tol, rtol=0)


@pytest.mark.parametrize("bad, message", [
    (dict(sinks=np.zeros(3)), "sinks has 3 logits, but q has 4 query heads"),
    (dict(softcap=-1.0), "softcap must be a finite positive number"),
    (dict(dropout=1.0), "dropout must be a probability"),
    (dict(bias=lambda h, a, b: np.zeros((7, 7, 7))), "bias(heads, q_pos, k_pos) must return"),
    (dict(mask=masks.function(lambda a, b: a + b)), "must return a bool array"),
    (dict(mask=masks.padding([3, 4, 5])), "one per batch entry"),
])
def test_bad_scores_raise_the_same_error_on_every_rank(bad, message):
    comm = _comm()
    P, r, S = comm.Get_size(), comm.Get_rank(), 16
    q, k, v, _, _ = _arrays(S)
    i = mpiring.shard_indices(S, P, r)
    with pytest.raises(ValueError, match=None) as info:
        mpiring.ring_attention(q[..., i, :], k[..., i, :], v[..., i, :], comm, **bad)
    assert message in str(info.value)


def test_a_ring_handle_takes_masks_and_scores_and_calls_may_repeat_them():
    comm = _comm()
    P, r, S = comm.Get_size(), comm.Get_rank(), 24
    q, k, v, dout, sinks = _arrays(S, seed=5)
    mask = masks.causal() | masks.prefix(5)
    opts = dict(mask=mask, softcap=4.0, sinks=sinks, return_max_logit=True)
    allowed = _allowed(S, opts)
    want_out, _, want_max = scored_attention(q, k, v, allowed, softcap=4.0, sinks=sinks)
    want = scored_attention(q, k, v, allowed, softcap=4.0, sinks=sinks, dout=dout)
    with mpiring.Ring(comm, S, layout="zigzag", **opts) as ring:
        i = ring.positions
        np.testing.assert_array_equal(np.sort(i), mpiring.shard_indices(S, P, r, "zigzag"))
        for call in ({}, dict(mask=masks.causal() | masks.prefix(5), softcap=4.0)):  # repeated options: equal
            out, lse, top = ring.forward(q[..., i, :], k[..., i, :], v[..., i, :], **call)
            np.testing.assert_allclose(out, want_out[..., i, :], atol=1e-10, rtol=0)
            np.testing.assert_allclose(top, want_max, atol=1e-10, rtol=0)
            dq, dk, dv, ds = ring.backward(dout[..., i, :], q[..., i, :], k[..., i, :], v[..., i, :], out, lse)
            for got, ref in zip((dq, dk, dv), want):
                np.testing.assert_allclose(got, ref[..., i, :], atol=1e-10, rtol=0)
            np.testing.assert_allclose(ds, want[3], atol=1e-10, rtol=0)
        with pytest.raises(ValueError, match="softcap"):
            ring.forward(q[..., i, :], k[..., i, :], v[..., i, :], softcap=5.0)


def test_root_scatter_and_gather_with_a_scored_spec():
    """distributed_attention(_backward) run a spec's mask and scores; with sinks the gradients include dsinks;
    a max logit is refused on every rank (it returns none)."""
    comm = _comm()
    S = 24
    q, k, v, dout, sinks = _arrays(S, seed=9)
    mask = masks.causal() | masks.prefix(4)
    spec = mpiring.Spec.of(mask=mask, softcap=2.0, sinks=sinks, layout="zigzag")
    out, _ = mpiring.distributed_attention(q, k, v, comm, spec=spec)
    grads = mpiring.distributed_attention_backward(q, k, v, dout, comm, spec=spec)
    allowed = _allowed(S, dict(mask=mask))
    if comm.Get_rank() == 0:
        np.testing.assert_allclose(out, scored_attention(q, k, v, allowed, softcap=2.0, sinks=sinks)[0], atol=1e-10)
        want = scored_attention(q, k, v, allowed, softcap=2.0, sinks=sinks, dout=dout)
        assert len(grads) == 5
        for got, ref in zip(grads, want):
            np.testing.assert_allclose(got, ref, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="returns no max logit"):
        mpiring.distributed_attention(q, k, v, comm, spec=spec.replace(return_max_logit=True))
