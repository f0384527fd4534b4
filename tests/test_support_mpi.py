"""The support matrix (``mpiring.tools.support``) through the real ring: every cell works or raises alike.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_support_mpi.py

At P = 2 (and with --full at P = 4) every cell of the matrix runs (``support.matrix``): per strategy,
every option alone, the options that work alone in the rows of a covering design of strength 2 (every
pair of them meets in a row), and every pair of options of a row that failed. That is not the full product of the axes
(``python -m mpiring support --full``, minutes): a failure that needs three options together is seen
only if one of the rows holds all three. At other sizes a seeded sample runs, half of it from the
full product, half from the cells with at most two options (P = 8: ``test_sample_at_8``, which skips
at other sizes). The tests check invariants, not which
cells raise: no cell is WRONG (outside the tolerance, a different error on some rank, an error
after data moved, or an exception other than ValueError, reported here as a WRONG cell so that one
crash does not hide the rest), every rank reached the same verdicts, a raising cell sent nothing, and
the tables in docs/reliability.md are what the matrix gives now.
"""

import os

import pytest
from mpi4py import MPI

from mpiring.core.record import Record
from mpiring.tools import support

pytestmark = pytest.mark.mpi

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "reliability.md")
SAMPLED = 40  # cases (forward and backward each) at sizes other than 2, 4 and 8
SAMPLED_AT_8 = 28  # two per strategy


def _sample(P, n):
    """Half of ``n`` from the full product, half from the cells with at most two options (where most run)."""
    return support.sample(P, n // 2, seed=P) + support.sample(P, n - n // 2, seed=P + 1, most=2)


def _matrix_at(P, config):
    """Whether the whole matrix runs at P: at 2, and at 4 with --full (the quick suite samples it there)."""
    return P == 2 or (P == 4 and config.getoption("--full"))


@pytest.fixture(scope="module")
def verdicts(request):
    """The matrix at P = 2 (and 4 with --full), a seeded sample of the full product at other sizes."""
    comm = MPI.COMM_WORLD
    if _matrix_at(comm.size, request.config):
        return support.matrix(comm, keep_going=True)
    if comm.size == 8:
        return None  # test_sample_at_8 draws its own
    return support.run_cells(comm, _sample(comm.size, SAMPLED), keep_going=True)


def _check(comm, verdicts):
    """Every rank has the same verdicts, and none is WRONG (the message lists the WRONG ones)."""
    assert len({tuple(v.items()) for v in comm.allgather(verdicts)}) == 1, "ranks reached different verdicts"
    wrong = [f"{c.strategy}, {support.label(c)}, {c.pass_}: {v}" for c, v in verdicts.items() if v.startswith("WRONG")]
    if wrong:
        pytest.fail(f"{len(wrong)} WRONG cells at P = {comm.size}:\n" + "\n".join(wrong), pytrace=False)


def test_every_cell_works_or_raises_alike(comm, verdicts):
    if comm.size == 8:
        pytest.skip("P = 8 runs test_sample_at_8")
    assert verdicts
    _check(comm, verdicts)


def test_sample_at_8(comm):
    """Two cases per strategy of the full product at P = 8 (oversubscribed here)."""
    if comm.size != 8:
        pytest.skip("runs under mpiexec -n 8")
    _check(comm, support.run_cells(comm, _sample(8, SAMPLED_AT_8), keep_going=True))


def test_a_raising_cell_sent_nothing(comm, verdicts):
    """Each error's first cell, run again with Records of our own: it raised before any data moved."""
    if verdicts is None:
        pytest.skip("P = 8 runs test_sample_at_8")
    first = {}
    for cell, v in verdicts.items():
        if v.startswith("raises: "):
            first.setdefault(v, cell)
    if not first:
        pytest.skip("no cell raises")
    for v, cell in first.items():
        records = (Record(comm.rank), Record(comm.rank))
        got = support.run_case(comm, cell[:-1], records=records)
        assert got[cell.pass_] == v
        rec = records[0] if got["forward"] == v else records[1]  # the pass that raised
        assert (rec.bytes_sent, rec.messages, rec.events, rec.tasks) == (0, 0, [], []), (cell, v)


def test_the_doc_holds_the_matrix(comm, verdicts, request):
    """docs/reliability.md holds the tables the matrix gives at this P (P = 2 and 4)."""
    if comm.size not in (2, 4):
        pytest.skip("the doc holds the matrix at P = 2 and 4")
    if not _matrix_at(comm.size, request.config):
        pytest.skip("the matrix at P = 4 runs with --full")
    if any(v.startswith("skipped") for v in verdicts.values()):
        pytest.skip("cells were skipped here (bfloat16 needs ml_dtypes)")
    with open(DOC) as f:
        held = support.doc_section(f.read(), comm.size)
    want = support.render(verdicts, comm.size, markdown=True)
    assert held == want, (f"docs/reliability.md is out of date at P = {comm.size}: run "
                          f"mpiexec -n {comm.size} python -m mpiring support --markdown --write docs/reliability.md")
