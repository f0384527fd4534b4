"""Agreement in every entry point (issues 41, 48): one option or datum differing on one rank, or one rank failing.

    python -m pytest -q tests/test_agreement.py

``test_every_entry_point_at_P`` runs ``tests/agreement_job.py`` (every case in
one ``mpiexec`` job) at P = 3, and at P = 2 and 4 too with ``--full``: in every case every rank raises the same
ValueError, whose text has the case's words, within seconds; a case that
leaves a rank waiting hangs the job and its limit fails the test. The table of
docs/reliability.md §1b is the job's, word for word. The rest checks what a
function's content is (``mpiring.plans.content``) on one process.
"""

import functools
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from mpiring import masks
from mpiring.plans.content import Unreadable, content, difference, first_difference, leaf_value
from mpiring.plans.spec import Spec

from launch import MPIEXEC, mpiexec_argv, run_limited

HERE = os.path.dirname(__file__)
JOB = os.path.join(HERE, "agreement_job.py")
sys.path.insert(0, HERE)
import agreement_job  # noqa: E402

QUICK = ("a bias raising at one pair inside the ring",)  # announced: seconds, not the timeout (20 s, or 60 s)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("P", [pytest.param(2, marks=pytest.mark.full), 3, pytest.param(4, marks=pytest.mark.full)])
def test_every_entry_point_at_P(P):  # quick suite: P = 3 (rank 0, a rank between and the odd one); --full: 2, 3, 4
    cmd = mpiexec_argv(P, sys.executable, JOB)
    code, out, err = run_limited(cmd, 120 + 30 * P)
    assert code == 0, f"{' '.join(cmd)}\n{out}\n{err[-3000:]}"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["case"] for r in results] == agreement_job.runnable()  # every case where torch and transformers are
    for r in results:
        entry, what = agreement_job.CASES[r["case"]][:2]
        outcomes, want = r["outcomes"], agreement_job.expected(r["case"], P)
        assert len(outcomes) == P
        assert all(o == outcomes[0] for o in outcomes), (entry, what, outcomes)
        assert outcomes[0].startswith("ValueError: ") and want in outcomes[0], (entry, what, outcomes[0], want)
        bound = 10 if what.startswith(QUICK) else 60
        assert max(r["seconds"]) < bound, (entry, what, r["seconds"])


def test_the_docs_table_is_the_jobs():
    with open(os.path.join(HERE, "..", "docs", "reliability.md")) as f:
        text = f.read()
    assert agreement_job.table() in text, "docs/reliability.md §1b: paste `python tests/agreement_job.py --table`"


# ---------------------------------------------------------------- content on one process


def _named(a, b, name="mask"):
    """The message naming the first difference of ``b`` (rank 1) from ``a`` (rank 0), as the agreement gives it."""
    mine, ref = content(b, name), content(a, name)
    i = first_difference(mine, ref)
    if i is None:
        return None
    leaves = [c.leaves[i] if i < len(c.leaves) else None for c in (mine, ref)]
    return difference(i, leaves, (leaf_value(mine, i), leaf_value(ref, i)), (1, 0))


def _closure(data):
    def reads(q, k):
        return data
    return reads


TABLE = np.arange(5)


def _reads_table(q, k):
    return TABLE[k % 5] > q


def test_equal_data_is_equal_content_whatever_the_objects():
    torch = pytest.importorskip("torch")
    t = torch.arange(10_000) % 3 == 0
    pairs = [(_closure(t), _closure(t.clone())), (_closure([np.arange(9)]), _closure([np.arange(9)])),
             (functools.partial(np.less, 3), functools.partial(np.less, 3)),
             (_closure({"b": 1, "a": (2, 3)}), _closure({"a": (2, 3), "b": 1})),
             (_closure({"x", "y", 3}), _closure({3, "y", "x"})), (masks.alibi(6), masks.alibi(6))]
    for a, b in pairs:
        assert content(a) == content(b) and _named(a, b) is None


def test_one_element_is_found_and_named():
    torch = pytest.importorskip("torch")
    t = torch.zeros(10_000, dtype=torch.bool)
    u = t.clone()
    u[9_999] = True
    assert _named(_closure(t), _closure(u)) == ("mask: closure cell 'data' (torch.Tensor bool (10000,)): first "
                                                 "differing element 9999: rank 0 has False, rank 1 has True")
    a = np.arange(12.0).reshape(3, 4)
    b = a.copy()
    b[2, 1] = -1
    assert _named(_closure(a), _closure(b)).endswith("first differing element (2, 1): rank 0 has 9.0, rank 1 has -1.0")


def test_a_global_the_function_reads_is_part_of_it():
    global TABLE
    before = content(_reads_table)
    TABLE = np.arange(5) + (np.arange(5) == 3)
    try:
        after = content(_reads_table)
    finally:
        TABLE = np.arange(5)
    assert before != after
    i = first_difference(after, before)
    assert after.leaves[i].path == "value: global 'TABLE'"


def test_functions_objects_defaults_and_partials_differ_by_what_they_read():
    class Width:
        def __init__(self, w):
            self.w = w

        def __call__(self, q, k):
            return abs(q - k) < self.w

    def make(w):
        def windowed(q, k, width=w):
            return abs(q - k) < width
        return windowed

    assert _named(Width(3), Width(4)) == "mask.w (int): rank 0 has 3, rank 1 has 4"
    assert _named(make(3), make(4)) == "mask: default 'width' (int): rank 0 has 3, rank 1 has 4"
    assert _named(functools.partial(np.less), functools.partial(np.greater)) == \
        "mask: its function: rank 0 has builtin numpy.less, rank 1 has builtin numpy.greater"
    assert _named(lambda q, k: q < k, lambda q, k: q > k).endswith("<lambda>): the code differs")


def test_what_cannot_be_read_is_refused_by_name():
    lock = threading.Lock()
    with pytest.raises(Unreadable, match=r"mask Function\(_closure.<locals>.reads\)\.fn: closure cell 'data' is a "
                                         r"_thread\.lock whose content mpiring cannot read"):
        Spec.of(mask=masks.function(_closure(lock)))
    with pytest.raises(ValueError, match=r"bias: closure cell 'data' reads the module mpi4py.MPI: a mask, bias or "
                                         r"score function must compute the same on every rank"):
        from mpi4py import MPI
        Spec.of(bias=_closure(MPI))
    generator = (i for i in range(3))
    with pytest.raises(Unreadable, match="a generator"):
        content(_closure(generator))


def test_a_cycle_is_seen_once():
    a = [1, 2]
    a.append(a)
    found = content(_closure(a))
    assert found.leaves[-1] [:2] == ("value: closure cell 'data'[2]", "the same object as value: closure cell 'data'")


def test_numpy_kernel_loads_no_torch():
    """MPIRING_KERNEL=numpy: checking the choice (every call's checks do) imports nothing of torch."""
    code = ("import sys, numpy as np, mpiring; from mpiring.plans.checks import backend_problem; "
            "assert backend_problem() is None; "
            "q = np.ones((1, 4, 8)); mpiring.ring_attention(q, q, q); print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MPIRING_KERNEL="numpy"))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
