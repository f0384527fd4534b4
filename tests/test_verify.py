"""The run command's checker (mpiring.tools.verify) against the dense single-process reference.

    python -m pytest -q tests/test_verify.py

The checker streams over seeded key blocks with an online softmax; the dense
reference (mpiring.core.reference) builds whole score matrices. Both must agree to
float64 rounding on every mask, with grouped-query heads, across block edges.
"""

import numpy as np
import pytest

from mpiring import shard_indices
from mpiring.core.reference import definition_mask, dense_attention, dense_attention_backward
from mpiring.tools import verify
from mpiring.tools.verify import BLOCK, Inputs


def _full(inputs, kind, seq_len):
    return inputs.tokens(kind, np.arange(seq_len)).astype(np.float64)


def _dense(inputs, seq_len, mask):
    """The dense reference on the whole seeded sequence: ``{out, lse, dq, dk, dv}``, and dout."""
    q, k, v, dout = (_full(inputs, kind, seq_len) for kind in verify.KINDS)
    pos = np.arange(seq_len)

    def dense(a, b):
        return definition_mask(pos[a:b], pos, **mask)

    out, lse = dense_attention(q, k, v, mask=dense)
    dq, dk, dv = dense_attention_backward(dout, q, k, v, mask=dense)
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv), dout


MASKS = [dict(), dict(causal=True), dict(causal=True, window=(100, 0)), dict(window=(-1, 7)),
         dict(causal=True, cu_seqlens=[0, 300, 1100, 1300])]


@pytest.mark.parametrize("mask", MASKS)
def test_streamed_reference_equals_the_dense_one(mask):
    seq_len = 1300  # two seeded blocks, the second one partly used
    inputs = Inputs(7, 1, 2, 1, 8, np.float32)  # grouped-query heads, two per K/V head
    want, dout = _dense(inputs, seq_len, mask)
    want_out, want_lse, want_dq, want_dk, want_dv = want.values()
    pos = np.arange(seq_len)
    rows = np.array([0, 5, 299, 300, 1023, 1024, 1099, 1299])
    scale = 1 / np.sqrt(8)
    out, lse = verify.forward_reference(inputs, rows, seq_len, scale, mask)
    np.testing.assert_allclose(out, want_out[..., rows, :], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[..., rows], rtol=0, atol=1e-12)
    dq = verify.dq_reference(inputs, rows, seq_len, scale, mask, out, lse)
    np.testing.assert_allclose(dq, want_dq[..., rows, :], rtol=0, atol=1e-12)
    every_out, every_lse = verify.forward_reference(inputs, pos, seq_len, scale, mask)
    delta = np.sum(dout * every_out, axis=-1)
    dk, dv = verify.dkv_reference(inputs, rows, seq_len, scale, mask, every_lse, delta)
    np.testing.assert_allclose(dk, want_dk[..., rows, :], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dv, want_dv[..., rows, :], rtol=0, atol=1e-12)


@pytest.mark.parametrize("scores", [pytest.param(dict(softcap=2.0), marks=pytest.mark.full),  # each alone: --full
                                    pytest.param(dict(sinks=np.array([0.5, -1.0, 2.0, 0.0])), marks=pytest.mark.full),
                                    pytest.param(dict(dropout=0.2, seed=4), marks=pytest.mark.full),
                                    dict(softcap=3.0, sinks=np.ones(4), dropout=0.1)])
def test_streamed_scores_equal_the_dense_scored_reference(scores):
    """The run's checker with softcap, sinks and dropout against core.reference.scored_attention (dense)."""
    from mpiring.core.reference import scored_attention
    seq_len, mask = 1100, dict(causal=True, window=(300, 0))
    inputs = Inputs(3, 1, 4, 2, 8, np.float64)
    q, k, v, dout = (_full(inputs, kind, seq_len) for kind in verify.KINDS)
    pos = np.arange(seq_len)
    allowed = definition_mask(pos, pos, **mask)
    want_out, want_lse, _ = scored_attention(q, k, v, allowed, **scores)
    want = scored_attention(q, k, v, allowed, dout=dout, **scores)
    rows = np.array([0, 7, 500, 1023, 1024, 1099])
    scale, checker = 1 / np.sqrt(8), verify.Scores(**scores)
    out, lse = verify.forward_reference(inputs, rows, seq_len, scale, mask, checker)
    np.testing.assert_allclose(out, want_out[..., rows, :], rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse[..., rows], rtol=0, atol=1e-12)
    dq = verify.dq_reference(inputs, rows, seq_len, scale, mask, out, lse, checker)
    np.testing.assert_allclose(dq, want[0][..., rows, :], rtol=0, atol=1e-12)
    every_out, every_lse = verify.forward_reference(inputs, pos, seq_len, scale, mask, checker)
    dk, dv = verify.dkv_reference(inputs, rows, seq_len, scale, mask, every_lse, np.sum(dout * every_out, axis=-1),
                                  checker)
    np.testing.assert_allclose(dk, want[1][..., rows, :], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dv, want[2][..., rows, :], rtol=0, atol=1e-12)


def test_inputs_are_the_same_whoever_makes_them():
    """A token's values depend on the seed, its kind and its position only: not on the shard or the length."""
    inputs = Inputs(3, 2, 2, 1, 4, np.float64)
    whole = inputs.tokens("k", np.arange(3000))
    for size, layout in ((4, "zigzag"), (3, "striped"), (5, "contiguous")):
        for rank in range(size):
            idx = shard_indices(3000, size, rank, layout)
            np.testing.assert_array_equal(inputs.tokens("k", idx), whole[..., idx, :])
    assert np.array_equal(Inputs(3, 2, 2, 1, 4, np.float64).tokens("k", np.arange(10)), whole[..., :10, :])
    assert not np.array_equal(inputs.tokens("q", np.arange(10))[:, :1], whole[..., :10, :])  # kinds differ
    assert inputs.block("v", 1).shape == (2, 1, BLOCK, 4)
    assert Inputs(3, 1, 2, 1, 4, np.float32).tokens("q", [5]).dtype == np.float32


def test_samples():
    assert np.array_equal(verify.sample_rows(200, 0, 1, "rows"), np.arange(200))
    rows = verify.sample_rows(5000, 0, 1, "rows")
    assert len(rows) == verify.SAMPLE and np.all(np.diff(rows) > 0) and rows[-1] < 5000
    assert np.array_equal(rows, verify.sample_rows(5000, 0, 1, "rows"))
    assert not np.array_equal(rows, verify.sample_rows(5000, 0, 2, "rows"))


def test_check_rank_finds_a_wrong_row():
    """The per-rank check on correct results passes; one wrong value is seen."""
    seq_len, size, mask = 600, 2, dict(causal=True)
    inputs = Inputs(0, 1, 2, 2, 8, np.float64)
    full, _ = _dense(inputs, seq_len, mask)

    for rank in range(size):
        idx = shard_indices(seq_len, size, rank, "zigzag")
        got = {name: (a[..., idx] if name == "lse" else a[..., idx, :]) for name, a in full.items()}

        def share(piece, rank=rank):  # the other ranks' pieces, as they would send them
            res = []
            for r in range(size):
                own = shard_indices(seq_len, size, r, "zigzag")
                o, l_ = verify.forward_reference(inputs, own, seq_len, 1 / np.sqrt(8), mask)
                d = np.sum(inputs.tokens("dout", own) * o, axis=-1)
                res.append(piece if r == rank else np.stack([l_, d]))
            return res

        result = verify.check_rank(inputs, seq_len, size, rank, "zigzag", mask, got, share)
        assert result["rows"] == len(idx) == 300 and result["keys"] == verify.SAMPLE
        assert max(result["error"].values()) < 1e-12, result
        got["dv"] = got["dv"].copy()
        got["dv"][0, 1, verify.sample_rows(len(idx), 0, rank, "keys")[5], 3] += 1e-6
        assert verify.check_rank(inputs, seq_len, size, rank, "zigzag", mask, got, share)["error"]["dV"] > 9e-7


def test_partition_check():
    assert verify.check_partition(1000, 3, "zigzag") is None
