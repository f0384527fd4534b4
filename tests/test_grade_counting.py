"""The grader's product counting (mpiring.tools.grade.flops) and its work verdicts, without MPI launches.

    python -m pytest -q tests/test_grade_counting.py
"""

import numpy as np
import pytest

from mpiring import make_plan
from mpiring.tools.grade.cases import EXERCISES
from mpiring.tools.grade.flops import Counted, Meter, counted
from mpiring.tools.grade.work import Work, allowed_pairs, work_verdict

H, N, D = 2, 8, 4


@pytest.fixture
def qkv():
    rng = np.random.default_rng(0)
    return [counted(rng.standard_normal((H, N, D))) for _ in range(3)]


PRODUCTS = [  # (name, product of q and k, multiply-adds)
    ("@", lambda q, k: q @ np.swapaxes(k, -1, -2), H * N * N * D),
    ("matmul of a slice", lambda q, k: np.matmul(q[:, N // 2:], k.transpose(0, 2, 1)), H * N // 2 * N * D),
    ("einsum", lambda q, k: np.einsum("hqd,hkd->hqk", q, k), H * N * N * D),
    ("einsum with ... and optimize", lambda q, k: np.einsum("...qd,...kd->...qk", q, k, optimize=True), H * N * N * D),
    ("dot method", lambda q, k: q[0].dot(k[0].T), N * N * D),
    ("tensordot", lambda q, k: np.tensordot(q[0], k[0], axes=([1], [1])), N * N * D),
    ("astype then @", lambda q, k: q.astype(np.float32) @ k.astype(np.float32)[0].T, H * N * N * D),
    ("inner", lambda q, k: np.inner(q[0], k[0]), N * N * D),
    ("vdot", lambda q, k: np.vdot(q, k), H * N * D),
    ("scaling is no product", lambda q, k: np.dot(q, 2.0), 0),
    ("plain arrays are not counted", lambda q, k: np.asarray(q) @ np.asarray(k).swapaxes(-1, -2), 0),
]


@pytest.mark.parametrize("name, product, macs", PRODUCTS, ids=[p[0] for p in PRODUCTS])
def test_products_are_counted_once(qkv, name, product, macs):
    q, k, _ = qkv
    with Meter() as meter:
        product(q, k)
    assert meter.macs == macs


def test_results_stay_counted(qkv):
    """Views, arithmetic, np.where, empty_like, out= and pickling keep the type, so the tally follows the data."""
    import pickle

    q, k, v = qkv
    with Meter() as meter:
        s = q @ np.swapaxes(k, -1, -2)
        p = np.exp(np.where(s > 0, s, -np.inf) - s.max(axis=-1, keepdims=True))
        buffer = np.empty_like(v)
        out = np.zeros((H, N, D))
        assert np.matmul(p, v, out=out) is out
        for x in (s, p, buffer, q[..., 1:, :], q.copy(), pickle.loads(pickle.dumps(q))):
            assert type(x) is Counted
        assert meter.macs == 2 * H * N * N * D
    assert isinstance(q, np.ndarray) and type(np.asarray(q)) is np.ndarray


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_the_allowed_work_is_the_plan_with_the_own_block_whole(P):
    contiguous = make_plan(N * P, P, causal=True)
    assert allowed_pairs(contiguous) == [(r + 1) * N * N for r in range(P)]
    zigzag = make_plan(N * P, P, layout="zigzag", causal=True)
    assert allowed_pairs(zigzag) == [N * N + (P - 1) * N * N // 2] * P
    assert all(a >= v for a, v in zip(allowed_pairs(zigzag), zigzag.visible_pairs()))


def test_an_unbalanced_zigzag_fails_and_uncounted_work_is_not_judged():
    block = N * N
    allowed = [2 * block] * 3
    visible = [block] * 3
    unbalanced = work_verdict(EXERCISES["zigzag"], Work([1.5 * block, 2 * block, 2 * block], allowed, visible, block))
    assert unbalanced.status == "FAIL" and "max/min 1.33" in unbalanced.short
    assert [kind for kind, _ in unbalanced.hints] == ["balance"]
    short = work_verdict(EXERCISES["causal"], Work([0.0, 0.0, 0.0], allowed, visible, block, problem="no product"))
    assert short.status == "not judged"
    assert work_verdict(EXERCISES["causal"], None).status == "not run"
