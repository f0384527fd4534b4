"""The planted bugs of docs/testing.md: each one-line change to mpiring fails the quick-suite test named beside it.

    python -m pytest -q tests/test_planted.py          # each bug's line is in the code, its test exists, the table
    python -m pytest -q --full tests/test_planted.py   # and each bug, planted in a copy of the checkout, fails its test

With ``--full`` each bug is planted in a copy of the checkout (its ``mpiring`` first on PYTHONPATH), and the test
named runs there as the quick suite runs it: serially for P = 1, else under ``mpiexec -n P``. A run that passes,
or fails for another reason than a failing test (an import error, a hang past the limit), fails here.
"""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import needs_torch
from launch import MPIEXEC, clean_env, mpiexec_argv, run_limited

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 300  # seconds: a catching run still going then has hung


@dataclasses.dataclass(frozen=True)
class Bug:
    what: str  # as docs/testing.md's table names it
    path: str  # under mpiring/
    old: str  # the line as it is (once in the file)
    new: str  # the planted line
    test: str  # the quick-suite test that fails
    P: int  # at that many ranks (1: the serial stage)


PLANTED = [
    Bug("the merge without the log-sum-exp weights", "core/kernels.py",
        "    w = np.exp(block_lse - np.where(np.isneginf(new_lse), 0, new_lse))[..., None]",
        "    w = np.full(np.shape(block_lse), 0.5)[..., None]",
        "tests/test_kernels.py::test_fully_masked_rows_are_neutral", 1),
    Bug("causal mask off by one (a query misses itself)", "plans/visibility.py",
        "        hi = q_pos if not self.frame else (q_pos // self.frame + 1) * self.frame - 1",
        "        hi = q_pos - 1 if not self.frame else (q_pos // self.frame + 1) * self.frame - 1",
        "tests/test_ring_mpi.py::test_ring_attention_matches_reference", 2),
    Bug("the ring's schedule turned the wrong way", "plans/plan.py",
        "        return (rank - stream * step) % self.size",
        "        return (rank + stream * step) % self.size",
        "tests/test_schedule.py::test_rotation", 1),
    Bug("one K/V slot instead of two (a block received into the one being computed)", "core/buffers.py",
        "        i, self._next = self._next, 1 - self._next",
        "        i, self._next = 0, 0",
        "tests/test_ring_mpi.py::test_ring_attention_matches_reference", 3),
    Bug("a kept accumulator not cleared between calls (history)", "core/tiles.py",
        "    out.fill(value)",
        "    out.fill(value) if out.size == 0 else None",
        "tests/test_history_mpi.py::test_fresh_matches_float64", 2),
    Bug("a NaN score's row given lse -inf (the merge drops it)", "core/kernels.py",
        "    return np.where(np.isnan(total), np.nan, -np.inf)",
        "    return np.full(np.shape(total), -np.inf)",
        "tests/test_nonfinite.py", 1),
    Bug("one rank's bad input not shared by the agreement", "mpi/agree.py",
        "    message = verdict([g[0] for g in gathered]) or _differences(comm, values, [g[1] for g in gathered], "
        "timeout)",
        "    message = verdict([problem]) or _differences(comm, values, [g[1] for g in gathered], timeout)",
        "tests/test_agreement.py::test_every_entry_point_at_P", 1),
    Bug("the roll call never called (a missing rank not named)", "mpi/agree.py",
        "    roll = RollCall(comm)",
        "    roll = None",
        "tests/test_training_traps_mpi.py::test_a_rank_busy_between_ring_calls_is_not_a_failed_one", 2),
    Bug("the backend rule: `auto` giving every block to the NumPy kernel", "core/backends.py",
        '    return "torch" if least is not None and rows >= least else "numpy"',
        '    return "numpy"',
        "tests/test_backends.py::test_auto_gives_torch_the_blocks_of_many_rows", 1),
    Bug("a document's state carried into the next one (the ring of states)", "parallel/mixing/passing.py",
        "        if chain.cut[e]:\n            state = zero\n",
        "        if chain.cut[e]:\n            state = zero if out is None else out\n",  # this rank's previous chunk's
        "tests/test_mixers_mpi.py::test_recurrences_are_exact", 2),
]
IDS = [re.sub(r"\W+", "-", bug.what.split(" (")[0]).strip("-") for bug in PLANTED]


@pytest.mark.parametrize("bug", PLANTED, ids=IDS)
def test_the_planted_line_and_its_test_exist(bug):
    """The line a bug changes is in the code once, the test that catches it exists, and docs/testing.md's table
    names both (so the table stays true as the code moves)."""
    assert (ROOT / "mpiring" / bug.path).read_text().count(bug.old) == 1, f"{bug.path}: {bug.old!r}"
    path, _, name = bug.test.partition("::")
    assert not name or f"def {name}(" in (ROOT / path).read_text(), bug.test
    rows = [line for line in (ROOT / "docs" / "testing.md").read_text().splitlines()
            if line.startswith(f"| {bug.what} |")]
    assert len(rows) == 1, bug.what
    assert f"`{bug.test.removeprefix('tests/')}`" in rows[0] and f"P = {bug.P}" in rows[0], rows[0]


def _plant(bug, tmp):
    """A copy of the checkout with ``bug`` planted; its root."""
    copy = tmp / "checkout"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".*", "__pycache__", "*.egg-info", "build"))
    source = copy / "mpiring" / bug.path
    source.write_text(source.read_text().replace(bug.old, bug.new))
    return copy


@pytest.mark.full
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("bug", [pytest.param(b, marks=needs_torch) if "backends" in b.path else b for b in PLANTED],
                         ids=IDS)
def test_each_planted_bug_is_caught(bug, tmp_path):
    copy = _plant(bug, tmp_path)
    pytest_args = ["-m", "pytest", "--with-mpi", "-q", "-x", "-p", "no:cacheprovider", bug.test]
    if bug.P == 1:
        cmd = [sys.executable, *pytest_args]
    else:
        cmd = mpiexec_argv(bug.P, sys.executable, *pytest_args[:3], "-m", "mpi", *pytest_args[3:])
    code, out, _ = run_limited(cmd, LIMIT, stderr=subprocess.STDOUT, cwd=copy, env=clean_env(PYTHONPATH=str(copy)))
    assert code != 0 and re.search(r"\b\d+ failed\b", out), f"{bug.what}: not caught by {bug.test}\n{out[-3000:]}"
