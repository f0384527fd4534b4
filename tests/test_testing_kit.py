"""mpiring.testing: the reference against brute force, the tolerance messages, the strategy, the docs.

    python -m pytest --with-mpi -q tests/test_testing_kit.py

The reference is checked against a loop over single entries written from the formulas, and its
gradients against finite differences. docs/testing.md's files are written to a directory and
their tests run, serially and under ``mpiexec -n 2`` (a subprocess with a clean environment).
"""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

from mpiring import testing

from launch import MPIEXEC, clean_env, mpiexec_argv

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "testing.md"


def brute_force(q, k, v, visible, scale):
    """Entry by entry: out[h, i] = sum_j softmax_j(scale q_i . k_j over visible j) v_j, for one head each."""
    hq, sq, _ = q.shape
    g = hq // k.shape[0]
    out, lse = np.zeros((hq, sq, v.shape[-1])), np.full((hq, sq), -np.inf)
    for h in range(hq):
        for i in range(sq):
            js = [j for j in range(k.shape[1]) if visible(i, j)]
            if not js:
                continue
            s = np.array([scale * float(np.dot(q[h, i], k[h // g, j])) for j in js])
            w = np.exp(s - s.max())
            out[h, i] = sum(wj * v[h // g, j] for wj, j in zip(w, js)) / w.sum()
            lse[h, i] = s.max() + np.log(w.sum())
    return out, lse


OPTIONS = [
    ({}, lambda i, j: True),
    ({"causal": True}, lambda i, j: j <= i),
    ({"window": (2, 1)}, lambda i, j: i - 2 <= j <= i + 1),
    ({"window": (-1, 0)}, lambda i, j: j <= i),
    ({"causal": True, "window": (3, -1)}, lambda i, j: i - 3 <= j <= i),
    ({"cu_seqlens": [0, 4, 4, 9, 11]}, lambda i, j: (i < 4) == (j < 4) and (4 <= i < 9) == (4 <= j < 9)),
]


@pytest.mark.parametrize("options, visible", OPTIONS)
def test_reference_is_the_formula(options, visible):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((4, 11, 5))
    k, v = rng.standard_normal((2, 11, 5)), rng.standard_normal((2, 11, 3))  # grouped-query, g = 2
    out, lse = testing.reference(q, k, v, **options)
    want_out, want_lse = brute_force(q, k, v, visible, 1 / np.sqrt(5))
    np.testing.assert_allclose(out, want_out, atol=1e-13, rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=1e-13, rtol=0)


def test_positions_give_a_shard_its_rows():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 12, 4)) for _ in range(3))
    rows = np.array([1, 2, 9, 10])  # a zigzag-like shard
    full, full_lse = testing.reference(q, k, v, causal=True)
    part, part_lse = testing.reference(q[:, rows], k, v, causal=True, q_positions=rows)
    np.testing.assert_array_equal(part, full[:, rows])
    np.testing.assert_array_equal(part_lse, full_lse[:, rows])


def test_rows_that_see_nothing_give_zero_and_minus_infinity():
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 4, 2)) for _ in range(3))
    out, lse = testing.reference(q, k, v, causal=True, q_positions=[0, 1, 2, 3], k_positions=[4, 5, 6, 7])
    assert np.all(out == 0) and np.all(lse == -np.inf)


def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(4)
    q = rng.standard_normal((4, 6, 3))
    k, v = rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 3))
    dout = rng.standard_normal((4, 6, 3))
    grads = testing.reference_backward(dout, q, k, v, causal=True)
    eps = 1e-6
    for which, x in enumerate((q, k, v)):
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[index] += eps
            minus[index] -= eps
            args = [q, k, v]
            args[which] = plus
            up = np.sum(dout * testing.reference(*args, causal=True)[0])
            args[which] = minus
            down = np.sum(dout * testing.reference(*args, causal=True)[0])
            numeric[index] = (up - down) / (2 * eps)
        np.testing.assert_allclose(grads[which], numeric, atol=1e-7, rtol=0)


def test_assert_attention_close_names_the_worst_element():
    ref = np.zeros((2, 3, 4))
    got = ref.copy()
    got[1, 2, 3] = 1e-4
    with pytest.raises(AssertionError, match=r"out: max error 0.0001 at index \(1, 2, 3\) .* float32 tolerance 1e-05"):
        testing.assert_attention_close(got, ref, np.float32)
    testing.assert_attention_close(ref + 1e-13, ref, np.float64)
    grad_ref = np.full((2, 2), 100.0)
    testing.assert_attention_close(grad_ref + 5e-4, grad_ref, np.float32, what="dk")  # relative: 5e-6 <= 1e-5
    with pytest.raises(AssertionError, match="relative error"):
        testing.assert_attention_close(grad_ref + 5e-3, grad_ref, np.float32, what="dk")
    with pytest.raises(AssertionError, match="inf"):
        testing.assert_attention_close(np.full((2,), np.nan), np.zeros(2), np.float64)
    lse = np.array([-np.inf, 1.0])
    testing.assert_attention_close(lse, lse, np.float64, what="lse")  # -inf where the reference has -inf is exact


def test_tolerance_table():
    assert testing.tolerance(np.float64) == 1e-12 and testing.tolerance(np.float32) == 1e-5
    assert testing.tolerance(np.float16) == 1e-2 and testing.tolerance("bfloat16") == 3e-2
    with pytest.raises(KeyError):
        testing.tolerance(np.int32)


@settings(max_examples=60, deadline=None)
@given(problem=testing.attention_problems(3, np.float32, max_tokens_per_rank=5))
def test_drawn_problems_are_valid_for_their_ranks(problem):
    assert problem.P == 3 and 3 <= problem.seq_len <= 15
    assert problem.heads % problem.kv_heads == 0
    q, k, v = problem.arrays(seed=5)
    assert q.dtype == np.float32 and q.shape == (problem.heads, problem.seq_len, problem.dim)
    assert k.shape == v.shape == (problem.kv_heads, problem.seq_len, problem.dim)
    if problem.cu_seqlens is not None:
        cu = problem.cu_seqlens
        assert cu[0] == 0 and cu[-1] == problem.seq_len and list(cu) == sorted(cu)
    out, lse = testing.reference(q, k, v, **problem.options)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(lse))  # every row sees at least itself
    np.testing.assert_array_equal(problem.arrays(seed=5)[0], q)


def test_importing_the_kit_needs_neither_pytest_nor_hypothesis():
    code = ("import sys; sys.modules['hypothesis'] = None; sys.modules['pytest'] = None; "
            "import mpiring.testing as t; print(t.TOLERANCE[t.np.dtype('float64')])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "1e-12", result.stderr


# ---------------------------------------------------------------- docs/testing.md runs


def _doc_files(tmp_path):
    files = {}
    for block in re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M):
        name = re.match(r"# file: (\S+)", block).group(1)
        (tmp_path / name).write_text(block)
        files[name] = block
    assert set(files) == {"my_ring.py", "conftest.py", "test_my_ring.py", "test_properties.py"}
    return files


def _run(cmd, cwd):
    env = clean_env()  # no variables of a parent launch; Open MPI's root permission kept (tests/launch.py)
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(f"hung: {cmd}\n{output}") from None
    return job.returncode, output


def test_testing_md_runs_serially(tmp_path):
    _doc_files(tmp_path)
    code, output = _run([sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "."], tmp_path)
    assert code == 0, output
    assert "13 passed" in output, output


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_testing_md_runs_on_two_ranks(tmp_path):
    _doc_files(tmp_path)
    code, output = _run(mpiexec_argv(2, sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
                                     "."), tmp_path)
    assert code == 0, output
    assert output.count("13 passed") == 2, output


def test_testing_md_error_message_is_real():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    got, _ = testing.reference(q, k, v, causal=True, scale=1.0)
    want, _ = testing.reference(q, k, v, causal=True)
    with pytest.raises(AssertionError) as info:
        testing.assert_attention_close(got, want, np.float64)
    assert f"AssertionError: {info.value}" in DOC.read_text()
