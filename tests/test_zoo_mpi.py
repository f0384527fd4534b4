"""The bytes table of docs/balance.md (``python -m mpiring bench zoo``): measured, equal to predicted, and in the doc.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_zoo_mpi.py

A few masks of the zoo run forward and backward under each movement; every
rank's recorded bytes equal the cost model's, the sparse movement sends the
minimum (found from the masks' definition) and no more than the ring, and at
P = 2 and 4 the rows are the ones the doc shows.
"""

from pathlib import Path

import pytest

from mpiring.tools.bench import traffic

pytestmark = pytest.mark.mpi

DOC = Path(__file__).resolve().parent.parent / "docs" / "balance.md"
CHECKED = ["causal", "window 4", "documents of 24", "window 8 + documents of 24"]


def test_zoo_rows_are_measured_minimal_and_documented(comm):
    if comm.size == 1:
        pytest.skip("nothing moves on one rank")
    found, predicted = traffic.zoo_rows(comm, CHECKED)
    assert predicted, "a rank's recorded bytes differ from nodes.predicted_bytes"
    for name, layout, least, sent in found:
        assert sent["sparse"][0] == least, (name, layout)
        assert sent["sparse"][0] <= sent["ring"][0] <= sent["all-gather"][0], (name, layout)
        assert sent["sparse"][1] <= sent["ring"][1], (name, layout)
    if comm.size in (2, 4):
        doc = DOC.read_text()
        for line in traffic.zoo_table(found, comm.size, markdown=True).splitlines()[2:]:
            assert line in doc, line


def test_the_command_prints_the_table(comm, capsys):
    assert traffic.zoo(comm, ["--mask", "window 4"]) == 0
    if comm.rank == 0:
        assert "equal the cost model's" in capsys.readouterr().out


def test_an_unknown_mask_is_refused_alike_on_every_rank(comm):
    from mpiring.tools.cli import Agreed

    with pytest.raises(Agreed, match="unknown masks"):
        traffic.zoo(comm, ["--mask", "no such mask"])
