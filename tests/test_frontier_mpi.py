"""The bytes tables of top-k attention and MLA's latent (``python -m mpiring bench topk`` and ``latent``), on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_frontier_mpi.py

Rows of both tables: measured bytes equal to their models on every rank, the
sparse movement under the choice never above the dense ring, the latent's
bytes per token the formula's; at P = 4 the rows are those docs/masks.md and
docs/training.md show.
"""

from pathlib import Path

import pytest

from mpiring.tools.bench import traffic

pytestmark = pytest.mark.mpi

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_topk_rows_are_measured_and_documented(comm):
    rows = [(64, 2, "random"), (64, 2, "local")]
    found, ok = traffic.topk_rows(comm, rows)
    assert ok, "a rank's recorded bytes differ from the models"
    for S, k, inputs, sent in found:
        assert sent["top-k sparse fwd"] <= sent["dense ring fwd"], (inputs, S, k)
        assert sent["top-k sparse bwd"] == 2 * sent["top-k sparse fwd"]  # K/V, then each chosen key's partial
    if comm.size > 1:
        assert found[1][3]["top-k sparse fwd"] < found[0][3]["top-k sparse fwd"]  # nearby keys: fewer blocks
    if comm.size == 4:
        doc = (DOCS / "masks.md").read_text()
        for line in traffic.topk_table(found, 4, markdown=True).splitlines()[2:]:
            assert line in doc, line


def test_latent_rows_are_measured_and_documented(comm):
    found, ok = traffic.latent_rows(comm, {"small": traffic.LATENT_SHAPES["small"]})
    assert ok, "bytes per token differ from core.mla's formulas"
    if comm.size > 1:
        assert found[0][1]["latent fwd"] == (64 + 16) * 4 and found[0][1]["per-head fwd"] == 8 * 80 * 4
    if comm.size == 4:
        doc = (DOCS / "training.md").read_text()
        for line in traffic.latent_table(found, 4, markdown=True).splitlines()[2:]:
            assert line in doc, line


def test_the_commands_print_their_tables(comm, capsys, monkeypatch):
    monkeypatch.setattr(traffic, "TOPK_ROWS", [(16, 2, "local")])
    monkeypatch.setattr(traffic, "LATENT_SHAPES", {"small": traffic.LATENT_SHAPES["small"]})
    assert traffic.topk(comm, []) == 0
    assert traffic.latent(comm, ["--markdown"]) == 0
    if comm.rank == 0:
        out = capsys.readouterr().out
        assert "equal the models" in out and "| small | 8 heads, r 64" in out and "Measured equal" in out
