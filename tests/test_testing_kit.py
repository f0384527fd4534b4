"""mpiring.testing: the reference against brute force, the messages, the strategy, the helpers, the docs.

    python -m pytest --with-mpi -q tests/test_testing_kit.py

The reference is checked against a loop over single entries written from the formulas, and its
gradients against finite differences. docs/testing.md's table is checked against ``__all__``, and
its files are written to a directory and their tests run, serially and under ``mpiexec -n 2``
(a subprocess with a clean environment): there the strict fixture catches the send-before-receive
all-to-all, and with the documented fix the suite passes. The collective assertions and the
strict communicator under MPI: tests/test_strict_mpi.py.
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
    with pytest.raises(AssertionError, match=r"out: max error 0.0001 at row 2, head 1, column 3, index \(1, 2, 3\) .* "
                                             r"float32 tolerance 1e-05"):
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


def test_importing_the_kit_needs_neither_pytest_nor_hypothesis_nor_mpi():
    code = ("import sys; sys.modules['hypothesis'] = None; sys.modules['pytest'] = None; import numpy as np; "
            "import mpiring.testing as t; print(t.TOLERANCE[np.dtype('float64')], 'mpi4py' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "1e-12 False", result.stderr


def test_where_names_the_global_position_head_column_and_batch():
    pos = np.arange(16, 32)
    assert testing.compare.where_text((1, 10, 6), 3, "out", pos) == "global position 26 (row 10 here), head 1, column 6"
    assert testing.compare.where_text((0, 2, 3, 1), 4, "out") == "row 3, head 2, column 1, batch entry 0"
    assert testing.compare.where_text((2, 5), 2, "lse", pos) == "global position 21 (row 5 here), head 2"
    assert testing.compare.where_text((1, 0, 2), 3, "out", heads=[4, 5]) == "row 0, head 5, column 2"
    with pytest.raises(AssertionError, match=r"out: max error 0.5 at global position 20 \(row 4 here\), head 1, "
                                             r"column 0, index \(1, 4, 0\)"):
        ref = np.zeros((2, 5, 3))
        got = ref.copy()
        got[1, 4, 0] = 0.5
        testing.assert_attention_close(got, ref, np.float64, positions=pos)


def test_a_shard_without_keys_sees_nothing():
    out, lse = testing.reference(np.ones((2, 3, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 5)))
    assert out.shape == (2, 3, 5) and np.all(out == 0) and np.all(lse == -np.inf)


def test_the_block_diagnosis_names_a_skipped_block():
    """diagnose_forward: rank 3 of 4 left rank 1's block out (no MPI needed: every shard is known)."""
    P, n = 4, 6
    rng = np.random.default_rng(7)
    Q, K, V = (rng.standard_normal((2, n * P, 4)) for _ in range(3))
    shards = [np.arange(r * n, (r + 1) * n) for r in range(P)]
    keep = np.concatenate([shards[0], shards[2], shards[3]])
    q = Q[:, shards[3]]
    got, _ = testing.reference(q, K[:, keep], V[:, keep], causal=True, q_positions=shards[3], k_positions=keep)
    want, _ = testing.reference(q, K, V, causal=True, q_positions=shards[3])
    hints = testing.diagnose_forward(got, want, q, K, V, shards[3], shards, True, 1e-12, 3)
    assert hints[0][0] == "mask" and "rank 1's K/V block is skipped (it must be attended in full)" in hints[0][1]


def test_shape_helpers():
    x = np.arange(2 * 5 * 12.0).reshape(2, 5, 12)  # (B, S, H*D), H = 3, D = 4
    heads = testing.split_heads(x, 3)
    assert heads.shape == (2, 3, 5, 4) and np.array_equal(heads[1, 2, 4], x[1, 4, 8:12])
    assert np.array_equal(testing.merge_heads(heads), x)
    assert list(testing.head_indices(8, 4, 2)) == [4, 5]
    assert np.array_equal(testing.head_shard(heads, 3, 1), heads[:, 1:2])
    with pytest.raises(ValueError, match="cannot be split evenly"):
        testing.head_indices(6, 4, 0)
    with pytest.raises(ValueError, match="into 5 heads"):
        testing.split_heads(x, 5)


CONSTRAINTS = [  # (keyword arguments, what every draw must satisfy)
    ({"divisible": True}, lambda p: p.seq_len % p.P == 0),
    ({"heads_divisible": True}, lambda p: p.heads % p.P == 0 and p.kv_heads % p.P == 0),
    ({"heads_divisible": True, "gqa": True, "divisible": True},
     lambda p: p.kv_heads % p.P == 0 and p.heads > p.kv_heads and p.seq_len % p.P == 0),
    ({"gqa": False, "masks": ["causal"]},
     lambda p: p.heads == p.kv_heads and p.window is None and p.cu_seqlens is None),
    ({"masks": False, "dtypes": [np.float32, np.float64], "batch": 2},
     lambda p: not p.causal and p.dtype in (np.float32, np.float64) and p.batch in (1, 2)),
]


@pytest.mark.parametrize("P", [3, 4])
@pytest.mark.parametrize("options, holds", CONSTRAINTS)
def test_constrained_problems_waste_no_draw(P, options, holds):
    """Every one of 30 examples is generated and satisfies the constraints: none filtered out, at P = 3 and 4."""
    from hypothesis import HealthCheck

    seen = []

    @settings(max_examples=30, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(problem=testing.attention_problems(P, max_heads=4, **options))
    def check(problem):
        assert holds(problem) and problem.P == P and problem.heads % problem.kv_heads == 0, problem
        assert problem.arrays(0)[0].shape[-3:] == (problem.heads, problem.seq_len, problem.dim)
        seen.append(problem)

    check()
    assert len(seen) == 30


def test_unknown_mask_kinds_are_refused():
    with pytest.raises(ValueError, match="unknown mask kinds"):
        testing.attention_problems(2, masks=["sliding"])


def test_docs_table_lists_every_public_name():
    """docs/testing.md's table (its first section, before "## ") has a row for every name in
    mpiring.testing.__all__, and no other."""
    kit = DOC.read_text().split("\n## ")[0]
    rows = [line for line in kit.splitlines() if line.startswith("| `")]
    named = {m for row in rows for m in re.findall(r"`(\w+)", row.split(" | ")[0])}
    assert named == set(testing.__all__), (named ^ set(testing.__all__))
    for name in testing.__all__:  # each resolves (the lazy ones too)
        assert getattr(testing, name) is not None


# ---------------------------------------------------------------- docs/testing.md runs

FILES = {"my_ring.py", "conftest.py", "test_my_ring.py", "test_properties.py", "my_alltoall.py",
         "test_my_alltoall.py"}


def _doc_files(tmp_path):
    files = {}
    for block in re.findall(r"^```python\n(.*?)^```", DOC.read_text(), re.S | re.M):
        name = re.match(r"# file: (\S+)", block)
        if name:
            (tmp_path / name.group(1)).write_text(block)
            files[name.group(1)] = block
    assert set(files) == FILES
    return files


def _apply_fix(tmp_path):
    """Replace my_alltoall's alltoall by the block headed "# fix: my_alltoall.alltoall"."""
    fix = re.search(r"^```python\n# fix: my_alltoall.alltoall\n(.*?)^```", DOC.read_text(), re.S | re.M).group(1)
    path = tmp_path / "my_alltoall.py"
    source = path.read_text()
    start = source.index("def alltoall(")
    end = source.index("def head_parallel_attention(")
    path.write_text(source[:start] + fix + "\n\n" + source[end:])


def _run(cmd, cwd):
    env = clean_env()  # no variables of a parent launch; Open MPI's root permission kept (tests/launch.py)
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd,
                           start_new_session=True)
    try:
        output, _ = job.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(f"hung: {cmd}\n{output}") from None
    return job.returncode, output


PYTEST = ["-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", "."]


def test_testing_md_runs_serially(tmp_path):
    _doc_files(tmp_path)
    code, output = _run([sys.executable, *PYTEST], tmp_path)
    assert code == 0, output
    assert "13 passed, 1 skipped" in output, output  # the all-to-all needs two ranks


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_testing_md_runs_on_two_ranks(tmp_path):
    """On two ranks the strict fixture catches the documented all-to-all at 2 KiB; with the fix, all pass."""
    _doc_files(tmp_path)
    code, output = _run(mpiexec_argv(2, sys.executable, *PYTEST), tmp_path)
    assert code != 0 and output.count("1 failed, 13 passed") == 2, output
    shown = re.search(r"^```text\n(mpiring.testing.timed.Stuck: .*?)\n```", DOC.read_text(), re.S | re.M).group(1)
    pattern = re.escape(shown)
    for literal, regex in (("rank 0", r"rank \d"), ("rank 1", r"rank \d"), ("3.0 s", r"3\.\d s")):
        pattern = pattern.replace(re.escape(literal), regex)
    assert re.search(pattern, output), (shown, output)
    _apply_fix(tmp_path)
    code, output = _run(mpiexec_argv(2, sys.executable, *PYTEST), tmp_path)
    assert code == 0 and output.count("14 passed") == 2, output


def test_testing_md_error_message_is_real():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 16, 8)) for _ in range(3))
    got, _ = testing.reference(q, k, v, causal=True, scale=1.0)
    want, _ = testing.reference(q, k, v, causal=True)
    with pytest.raises(AssertionError) as info:
        testing.assert_attention_close(got, want, np.float64, positions=np.arange(16, 32))
    assert f"AssertionError: {info.value}" in DOC.read_text()
