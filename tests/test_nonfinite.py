"""NaN and Inf inputs without check_finite: never a finite result that is wrong.

    python -m pytest -q tests/test_nonfinite.py
    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_nonfinite.py

The rule (docs/reliability.md): NaN and Inf run through as IEEE arithmetic
has them. A row whose visible scores include NaN or +Inf (inf - inf in the
softmax) comes back NaN; a key whose score is -Inf gets weight 0; a
non-finite v poisons every row whose weighted sum multiplies it (even by a
probability 0: 0 x inf is NaN, in torch too). Rows that touch no non-finite
value are exact. Against torch SDPA (when installed): every row we return
non-finite, torch does too; torch also poisons rows where the bad score is
masked (it adds the mask as a -inf bias), which we keep exact.
"""

import numpy as np
import pytest

from mpiring import attention_block, ring_attention

from conftest import dense_mask, local, naive_attention

pytestmark = pytest.mark.usefixtures("each_kernel")  # every kernel test per GEMM and kernel backend

S, D = 40, 8


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 2, S, D)) for _ in range(3)]


def _poison(case, q, k, v):
    q, k, v = q.copy(), k.copy(), v.copy()
    {"q nan": lambda: q.__setitem__((0, 1, 5, 0), np.nan),
     "k +inf entry": lambda: k.__setitem__((0, 0, 10, 3), np.inf),
     "k -inf row": lambda: k.__setitem__((0, 0, 10), -np.inf),
     "k nan": lambda: k.__setitem__((0, 1, 30, 2), np.nan),
     "v inf": lambda: v.__setitem__((0, 0, 10, 0), np.inf)}[case]()
    return q, k, v


CASES = ["q nan", "k +inf entry", "k -inf row", "k nan", "v inf"]


def _expected_bad_rows(case, q, k, v, mask):
    """Rows whose arithmetic meets a non-finite value, per head: (heads, S) booleans."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = q @ np.swapaxes(k, -1, -2)
    bad_score = (np.isnan(s) | (s == np.inf)) & mask  # +inf or NaN among a row's visible scores
    bad = bad_score.any(axis=-1) | ~np.isfinite(q).all(axis=-1)
    if case == "v inf":  # every row that sees the key, at least
        bad |= (mask & ~np.isfinite(v).all(axis=-1)[..., None, :]).any(axis=-1)
    return bad[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_never_returns_finite_garbage(case, causal):
    q, k, v = _poison(case, *_inputs())
    mask = dense_mask(S, causal)
    klo, khi = (np.zeros(S, int), np.arange(S) + 1) if causal else (None, None)
    out, lse = attention_block(q, k, v, None, klo, khi)
    got_bad = ~np.isfinite(out).all(axis=-1)[0]
    want_bad = _expected_bad_rows(case, q, k, v, mask)
    assert (got_bad | ~want_bad).all(), "a row that meets a NaN/Inf came back finite"
    if case != "v inf":  # v: a probability 0 x inf may poison more rows (as in torch)
        assert (got_bad == want_bad).all()
    clean = ~got_bad
    ref = naive_attention(*(np.where(np.isfinite(a), a, 0) for a in (q, k, v)), mask)  # finite rows: exact
    if case in ("k +inf entry", "k -inf row"):  # rows that meet only -inf scores: those keys weigh 0
        ref = _masked_reference(q, k, v, mask)
    assert np.allclose(out[0][clean], ref[0][clean], atol=1e-12, rtol=0)


def _masked_reference(q, k, v, mask):
    with np.errstate(invalid="ignore", over="ignore"):
        s = q @ np.swapaxes(k, -1, -2)
    minus_inf = s == -np.inf
    return naive_attention(q, np.where(np.isfinite(k), k, 0), v, mask & ~minus_inf)


@pytest.mark.parametrize("case", CASES)
def test_same_rows_as_torch(case):
    torch = pytest.importorskip("torch")
    q, k, v = _poison(case, *_inputs())
    mask = dense_mask(S, causal=True)
    out, _ = attention_block(q, k, v, None, np.zeros(S, int), np.arange(S) + 1)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(mask)).numpy()
    ours_bad, theirs_bad = ~np.isfinite(out).all(axis=-1), ~np.isfinite(theirs).all(axis=-1)
    # torch adds the mask as a -inf bias, so a masked +inf or NaN score poisons its row too (inf - inf):
    # every row we return non-finite, torch does; rows finite in both agree
    assert (theirs_bad | ~ours_bad).all(), np.argwhere(ours_bad & ~theirs_bad)
    both = ~ours_bad & ~theirs_bad
    assert np.allclose(out[both], theirs[both], atol=1e-12, rtol=0)
    if case in ("q nan", "v inf"):  # no masked score involved: exactly torch's rows
        assert (ours_bad == theirs_bad).all()


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["k +inf entry", "v inf", "q nan"])
def test_ring_never_returns_finite_garbage(comm, case):
    """Through the ring, every layout: a row that meets a non-finite value is not finite."""
    P = comm.size
    rng = np.random.default_rng(P)
    Q, K, V = (rng.standard_normal((1, 2, 8 * P + 1, D)) for _ in range(3))
    n = Q.shape[-2]
    Q, K, V = (a[..., :n, :] for a in (Q, K, V))
    Q, K, V = _poison(case, Q, K, V) if n > 30 else (Q, K, V)
    if n <= 30:  # small P: poison a position that exists
        K = K.copy()
        K[0, 0, n // 2, 3] = np.inf
        case = "k +inf entry"
    mask = dense_mask(n, causal=True)
    want_bad = _expected_bad_rows(case, Q, K, V, mask)
    for layout in ("contiguous", "zigzag", "striped"):
        q, k, v = (local(x, comm, layout) for x in (Q, K, V))
        out, _ = ring_attention(q, k, v, comm, causal=True, layout=layout)
        got_bad = ~np.isfinite(out).all(axis=-1)[0]
        assert (got_bad | ~local(want_bad[:, :, None], comm, layout)[..., 0]).all()


def _score_bad_rows(q, k, mask):
    """Rows whose visible scores meet a NaN, and rows that meet +Inf (and no NaN): by the definition their lse is
    NaN, and +Inf (the log of an infinite sum; out is NaN there: inf / inf). (heads, S) per batch entry each."""
    with np.errstate(invalid="ignore", over="ignore"):
        s = q @ np.swapaxes(k, -1, -2)
    nan = (np.isnan(s) & mask).any(axis=-1) | np.isnan(q).any(axis=-1)
    return nan, ((s == np.inf) & mask).any(axis=-1) & ~nan


@pytest.mark.parametrize("case", ["q nan", "k nan", "k +inf entry"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_lse_is_not_finite_where_the_definition_is_not(case, causal):
    """A row whose scores meet a NaN has a NaN lse, not -inf (which a merge would drop as 'no key seen'); one that
    meets +Inf has lse +Inf; every other row a finite lse."""
    q, k, v = _poison(case, *_inputs())
    mask = dense_mask(S, causal)
    klo, khi = (np.zeros(S, int), np.arange(S) + 1) if causal else (None, None)
    with np.errstate(invalid="ignore"):
        _, lse = attention_block(q, k, v, None, klo, khi)
    nan, inf = _score_bad_rows(q, k, mask)
    assert (nan | inf).any()
    assert (np.isnan(lse) == nan).all(), np.argwhere(np.isnan(lse) != nan)
    assert (np.isposinf(lse) == inf).all() and np.isfinite(lse[~(nan | inf)]).all()


@pytest.mark.mpi
@pytest.mark.parametrize("where", ["k", "bias"])
def test_ring_lse_is_nan_on_every_rank_where_out_is(comm, where):
    """One NaN in K (or from a bias at one pair): every row that sees it has NaN out and NaN lse, on the rank that
    holds the key and on the others; every other row is finite (issue 48: the lse was -inf on the key's rank and
    finite elsewhere)."""
    P = comm.size
    n = 6 * P
    rng = np.random.default_rng(7)
    Q, K, V = (rng.standard_normal((1, 2, n, D)) for _ in range(3))
    options = dict(causal=True)
    if where == "k":
        K[0, 1, n // 3, 2] = np.nan
        bad = np.zeros((2, n), bool)
        bad[1, n // 3:] = True
    else:
        hit = (n - 2, 1)  # query n - 2 sees key 1 through a NaN bias, in every head
        options["bias"] = lambda h, a, b: np.where((a == hit[0]) & (b == hit[1]), np.nan, 0.0)
        bad = np.zeros((2, n), bool)
        bad[:, hit[0]] = True
    for layout in ("contiguous", "zigzag"):
        q, k, v = (local(x, comm, layout) for x in (Q, K, V))
        with np.errstate(invalid="ignore"):
            out, lse = ring_attention(q, k, v, comm, layout=layout, **options)
        want = local(bad[..., None], comm, layout)[..., 0]
        assert (np.isnan(out).any(axis=-1)[0] == want).all()
        assert (np.isnan(lse)[0] == want).all(), (comm.rank, layout, lse)
        assert np.isfinite(lse[0][~want]).all()
