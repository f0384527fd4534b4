"""The grader's parts that need no MPI: the case matrix and its selection, the summary table, the report.

    python -m pytest -q tests/test_grade_report.py
"""

import csv
import json

import numpy as np
import pytest

from mpiring.tools.grade.batch import parse_ranks
from mpiring.tools.grade.exercises import EXERCISES, declared_exercise, make_cases, select_terms, student_files
from mpiring.tools.grade.report import class_summary, entry, summary, write_csv, write_json
from mpiring.tools.grade.verdicts import Verdict, merge_rounds


@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_forward_cases_have_a_multiple_of_P_heads(P):
    """A head-parallel solution can be graded: no case has H = 1 at P > 1 (it cannot be split)."""
    cases = make_cases(EXERCISES["forward"], P)
    assert len(cases) == 16 and all(c.h % P == 0 and c.kv_heads == c.h for c in cases)
    assert {c.h for c in make_cases(EXERCISES["ring"], 3)} == {1, 2, 4}  # the ring labs keep theirs
    assert all(c.h % P == 0 and c.h // P >= 2 for c in make_cases(EXERCISES["ulysses"], P))
    assert all(c.h == 2 * c.kv_heads and c.kv_heads >= 2 for c in make_cases(EXERCISES["gqa"], P))


def test_case_selection():
    picked = make_cases(EXERCISES["forward"], 2, select=select_terms("medium, float32,causal"))
    assert [(c.size, np.dtype(c.dtype).name, c.causal) for c in picked] == [("medium", "float32", True)]
    assert len(make_cases(EXERCISES["forward"], 2, select=select_terms("tiny,large"))) == 8
    assert len(make_cases(EXERCISES["causal"], 2, quick=True)) == 4
    with pytest.raises(ValueError, match="unknown term 'huge'; valid: causal, float32, float64, large"):
        select_terms("huge")


def test_a_file_names_its_exercise(tmp_path):
    (tmp_path / "a.py").write_text('import numpy\n\nEXERCISE = "decode"\n')
    (tmp_path / "b.py").write_text('EXERCISE = "no such lab"\n')
    (tmp_path / "_helper.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    assert declared_exercise(tmp_path / "a.py") == "decode" and declared_exercise(tmp_path / "b.py") is None
    assert [p.split("/")[-1] for p in student_files([str(tmp_path)])] == ["a.py", "b.py"]


def test_ranks():
    assert parse_ranks("2,3,4") == [2, 3, 4] and parse_ranks("4,2,4") == [4, 2]
    for bad in ("", "0,2", "two"):
        with pytest.raises(ValueError, match="--ranks must be positive integers"):
            parse_ranks(bad)


def test_summary_cells_are_whole(capsys):
    """A long cell is printed whole (it was cut at 32 characters: "blocks per rank 1, 2, 3 (pla")."""
    work = Verdict("ok", "blocks per rank 1, 2, 3, 4, 5, 6, 7, 8 (plan 1, 2, 3, 4, 5, 6, 7, 8)")
    table = [("H=4 n=64 D=32 float64 causal", {"output": Verdict("ok", "max error 2.2e-16"),
                                                "traffic": Verdict("ok", "448 KiB/rank, model 448 KiB"),
                                                "safety": Verdict("ok")}),
             ("work: causal skipping", {"output": work})]
    summary(0, table, ("output", "traffic", "safety"), 8, 1.0, {})
    out = capsys.readouterr().out
    assert "ok  blocks per rank 1, 2, 3, 4, 5, 6, 7, 8 (plan 1, 2, 3, 4, 5, 6, 7, 8)" in out
    assert "ok  448 KiB/rank, model 448 KiB" in out and "PASS: all 4 checks passed" in out


def test_the_report_and_its_csv(tmp_path):
    table = [("case 1", {"output": Verdict("ok"), "safety": Verdict("ok")}),
             ("case 2", {"output": Verdict("FAIL", "wrong", ["rank 1 ..."], [("merge", "rescale")]),
                         "safety": Verdict("ok")}),
             ("case 3", {"output": Verdict("not run"), "safety": Verdict("not run")})]
    e = entry("class/bob.py", "ring", 3, table, {"merge": "rescale"}, 1.234)
    assert e["verdict"] == "fail" and e["checks"] == {"passed": 3, "failed": 1, "not_run": 2, "not_judged": 0}
    assert e["cases"][1]["checks"]["output"] == {"status": "FAIL", "short": "wrong", "details": ["rank 1 ..."]}
    ok = entry("class/al.py", "ring", 3, table[:1], {}, 0.5)
    write_json(tmp_path / "r.json", [e, ok], {"ranks": [3]})
    write_csv(tmp_path / "r.csv", [e, ok])
    assert json.loads((tmp_path / "r.json").read_text())["entries"][1]["verdict"] == "pass"
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert rows[0]["verdict"] == "fail" and rows[0]["hints"] == "rescale" and rows[1]["passed"] == "2"
    lines = class_summary([e, ok], [3], 2.0)
    assert lines[-1] == "1 of 2 gradings passed" and "FAIL (1 failed, 2 not run)" in "\n".join(lines)


class _Run:
    def __init__(self, received_from, collectives=()):
        self.received_from, self.collectives = received_from, dict.fromkeys(collectives, 1)


def test_merge_rounds():
    """A binary tree, a chain, a gather, a butterfly: rounds of messages before rank 0 has every partial."""
    tree = [_Run({1: 8, 2: 8}), _Run({}), _Run({3: 8}), _Run({})]
    chain = [_Run({1: 8}), _Run({2: 8}), _Run({3: 8}), _Run({})]
    gather = [_Run({}, ["gather"])] + [_Run({}, ["gather"]) for _ in range(3)]
    butterfly = [_Run({1: 8, 2: 8}), _Run({0: 8, 3: 8}), _Run({3: 8, 0: 8}), _Run({2: 8, 1: 8})]
    assert [merge_rounds(r) for r in (tree, chain, gather, butterfly)] == [2, 3, 3, 2]


def test_the_batch_grader_runs_outside_mpi(monkeypatch, capsys):
    """``grade --ranks`` starts the jobs itself: no MPI in its own process, and refused inside a job."""
    from mpiring.__main__ import needs_mpi
    from mpiring.tools.grade import grade_class

    assert needs_mpi("grade", ["class/", "--ranks", "2,3"]) is False
    assert needs_mpi("grade", ["student.py"]) is True and needs_mpi("run", []) is True
    monkeypatch.setenv("PMI_RANK", "0")
    assert grade_class(["tests/students", "--ranks", "2"]) == 2
    assert "run it without mpiexec" in capsys.readouterr().err
    monkeypatch.delenv("PMI_RANK")
    assert grade_class(["no/such/folder", "--ranks", "2"]) == 2
    assert "no such file or folder: no/such/folder" in capsys.readouterr().err
