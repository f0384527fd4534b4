"""The grader: correct rings pass; defective ones fail with the right hint, nothing hangs; a class in one report.

    python -m pytest -q tests/test_grade.py

The grading runs are batches: ``python -m mpiring grade FOLDER --ranks ...`` starts one mpiexec job
per P (each grading every file of the folder) and writes one JSON report; the tests read it. One
batch grades the defective rings of tests/students/ at P = 2, 3, 4 (each file names its exercise),
one the labs' solutions at P = 2, 3, 4, one the skeletons at P = 2, one the planted wrong versions
of the new labs (tests/students/labs/) at P = 4. Every launch runs with a hard time limit and a
clean MPI environment; the work and overlap checks count products, so their verdicts are the same
on every run, however loaded the machine.
"""

import csv
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import MPIEXEC, mpiexec_argv, run_limited

ROOT = Path(__file__).resolve().parent.parent
STUDENTS = ROOT / "tests" / "students"
EXERCISES = ROOT / "examples" / "exercises"
LIMIT = 60  # seconds: a launch still running then has hung
FAST = 20  # seconds: what a launch may take (the grader's own timeouts are 2 s here)

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")


def launch(P, module, *args, limit=LIMIT):
    """Run ``mpiexec -n P python -m module args``; return (exit code, stdout + stderr, seconds)."""
    cmd = mpiexec_argv(P, sys.executable, "-m", module, *args)
    start = time.perf_counter()
    code, output, _ = run_limited(cmd, limit, stderr=subprocess.STDOUT, cwd=ROOT)
    return code, output, time.perf_counter() - start


def batch(tmp, folder, ranks, *options, limit=400):
    """``python -m mpiring grade FOLDER --ranks RANKS --quick ...`` (no mpiexec): (code, output, report, csv rows)."""
    report, table = tmp / "report.json", tmp / "report.csv"
    cmd = [sys.executable, "-m", "mpiring", "grade", str(folder.relative_to(ROOT)), "--ranks", ranks, "--quick",
           "--timeout", "2", "--report", str(report), "--csv", str(table), *map(str, options)]
    code, output, _ = run_limited(cmd, limit, stderr=subprocess.STDOUT, cwd=ROOT)
    assert report.is_file(), output
    with open(table) as f:
        rows = list(csv.DictReader(f))
    return code, output, json.loads(report.read_text()), rows


def entry(report, name, P):
    found = [e for e in report["entries"] if Path(e["file"]).name == f"{name}.py" and e["P"] == P]
    assert len(found) == 1, [(e["file"], e["P"]) for e in report["entries"]]
    return found[0]


def details(e, check=None):
    """Every detail line of an entry's checks (of one check), as one text."""
    return "\n".join(line for c in e["cases"] for name, v in c["checks"].items() if check in (None, name)
                     for line in v["details"])


def case_cells(e):
    return {c["case"]: {n: v["status"] for n, v in c["checks"].items()} for c in e["cases"]}


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    """The repository's defective rings at P = 2, 3, 4 in one report."""
    return batch(tmp_path_factory.mktemp("students"), STUDENTS, "2,3,4", "--time-limit", 6)


EXPECTED = {  # file: (exercise, verdict at P = 2, 3, 4)
    "blocking_send": ("forward", "fail"), "causal_off_by_one": ("forward", "fail"),
    "compute_then_sendrecv": ("ring", "fail"), "correct_sendrecv": ("forward", "pass"),
    "endless_loop": ("forward", "fail"), "head_parallel": ("forward", "pass"), "kv_twice": ("forward", "fail"),
    "no_rescale": ("forward", "fail"), "no_skip": ("causal", "fail"), "plain_arrays": ("causal", "pass"),
    "wrong_source": ("forward", "fail"), "zigzag_no_skip": ("zigzag", "fail"),
}


def test_a_folder_of_students_is_graded_at_every_P_into_one_report(students):
    code, output, report, rows = students
    assert code == 1, output
    assert report["ranks"] == [2, 3, 4]
    assert sorted(Path(f).stem for f in report["files"]) == sorted(EXPECTED)
    got = {(Path(e["file"]).stem, e["P"]): (e["exercise"], e["verdict"]) for e in report["entries"]}
    assert got == {(name, P): want for name, want in EXPECTED.items() for P in (2, 3, 4)}, output
    assert {(Path(r["file"]).stem, int(r["P"])): (r["exercise"], r["verdict"]) for r in rows} == got
    assert f"{3 * 3} of {12 * 3} gradings passed" in output
    doc = (ROOT / "docs" / "course.md").read_text()  # the class summary course.md shows is this run's
    assert ("python -m mpiring grade tests/students --ranks 2,3,4 --quick --timeout 2 --time-limit 6 --report "
            "report.json --csv report.csv") in doc
    shown = re.search(r"^```text\n(class summary: .*?)\n```", doc, re.S | re.M).group(1).splitlines()
    printed = output.splitlines()
    assert re.sub(r"[0-9.]+ s$", "", shown[0]) in output and all(line in printed for line in shown[1:]), output


@pytest.mark.parametrize("P", [2, 3, 4])
def test_a_correct_ring_passes(students, P):
    e = entry(students[2], "correct_sendrecv", P)
    assert e["checks"] == {"passed": 12, "failed": 0, "not_run": 0, "not_judged": 0}
    assert all(set(cells.values()) == {"ok"} for cells in case_cells(e).values())


@pytest.mark.parametrize("P", [2, 3, 4])
def test_a_head_parallel_solution_is_graded(students, P):
    """Ulysses under the forward contract: every case has a multiple of P heads (H = 1 would not split)."""
    e = entry(students[2], "head_parallel", P)
    assert e["verdict"] == "pass", e
    assert all(int(re.match(r"H=(\d+)", c["case"]).group(1)) % P == 0 for c in e["cases"])


def test_blocking_sends_deadlock_and_are_reported_as_unsafe(students):
    e = entry(students[2], "blocking_send", 3)
    text = details(e, "safety")
    assert re.search(r"unsafe: rank 0 blocked in Send to rank 1 \(tag 0, [0-9.]+ KiB\) for 2\.\d s — every rank "
                     r"sends before it receives; use Isend/Irecv or Sendrecv", text), text
    for r in range(1, 3):
        assert f"rank {r} blocked in Send to rank {(r + 1) % 3}" in text
    assert e["checks"] == {"passed": 0, "failed": 1, "not_run": 11, "not_judged": 0}


def test_a_merge_without_rescale_is_named(students):
    e = entry(students[2], "no_rescale", 3)
    weights = " + ".join(f"{1 / 3:.2f} O{s}" for s in range(3))  # averaging P blocks: weights 1/P
    assert any("did you rescale with the log-sum-exp when merging?" in h and f"your output is {weights}" in h
               for h in e["hints"]), e["hints"]
    assert all(cells["traffic"] == "ok" and cells["safety"] == "ok" for cells in case_cells(e).values())


@pytest.mark.parametrize("P", [2, 4])
def test_a_causal_mask_off_by_one_block_is_named(students, P):
    e = entry(students[2], "causal_off_by_one", P)
    last = P - 1
    assert any(f"rank {last}'s output is exactly attention in which rank {last - 1}'s K/V block is masked with the "
               f"causal triangle (np.tril of the block) (it must be attended in full); rank {last}'s K/V block is "
               f"attended in full" in h and "causal mask off by one block?" in h for h in e["hints"]), e["hints"]
    for label, cells in case_cells(e).items():  # the non-causal cases are right
        assert cells["output"] == ("ok" if "non-causal" in label else "FAIL"), label


def test_sending_kv_twice_breaks_the_cost_model(students):
    e = entry(students[2], "kv_twice", 3)
    assert "you send K/V more than P - 1 times" in e["hints"][0]
    assert "2 x the cost model: (P - 1) = 2 K/V blocks per rank, i.e. 2 (P - 1) = 4 messages" in details(e, "traffic")
    assert [cells["traffic"] for cells in case_cells(e).values()] == ["FAIL"] * 4
    assert "FAIL" not in [cells["output"] for cells in case_cells(e).values()]


def test_a_receive_from_the_wrong_rank_is_caught_in_waitall(students):
    """MPI.Request.Waitall (through the student's MPI name) is timed too, and says who waited for whom."""
    e = entry(students[2], "wrong_source", 3)
    assert re.search(r"rank 0 waited 2\.\d s in Waitall", details(e)), details(e)
    assert "Irecv from rank 1 (tag 0" in details(e)
    assert any("a rank waits for a message nobody sends it" in h for h in e["hints"])


@pytest.mark.parametrize("P", [2, 4])
def test_causal_work_without_skipping_fails(students, P):
    """Counted products: rank 0 computed P blocks where it needs 1, on every run."""
    e = entry(students[2], "no_skip", P)
    work = [c for c in e["cases"] if c["case"] == "work: causal skipping"][0]["checks"]["output"]
    blocks, plan = ", ".join([str(P)] * P), ", ".join(str(r + 1) for r in range(P))
    assert (work["status"], work["short"]) == ("FAIL", f"blocks per rank {blocks} (plan {plan})")
    assert (f"rank 0 computed {P} blocks where it needs 1 (its own block): skip the blocks that lie entirely "
            f"after a rank's queries") in e["hints"]
    assert e["checks"] == {"passed": 12, "failed": 1, "not_run": 0, "not_judged": 0}


@pytest.mark.parametrize("P", [2, 3])
def test_zigzag_work_with_whole_blocks_fails(students, P):
    """Balanced, but every off-diagonal block computed whole: judged at P = 2 too, where timing could not tell."""
    e = entry(students[2], "zigzag_no_skip", P)
    work = [c for c in e["cases"] if c["case"] == "work: zigzag balance"][0]["checks"]["output"]
    plan = ", ".join([f"{1 + (P - 1) / 2:g}"] * P)
    assert work["short"] == f"blocks per rank {', '.join([str(P)] * P)} (plan {plan}), max/min 1"
    assert any("with zigzag shards each off-diagonal block is half visible; compute only the visible half" in h
               for h in e["hints"])


def test_uncountable_products_are_not_judged(students):
    """q, k, v made plain arrays (np.array): the work check says so, and the grade still passes."""
    e = entry(students[2], "plain_arrays", 2)
    work = [c for c in e["cases"] if c["case"] == "work: causal skipping"][0]["checks"]["output"]
    assert (work["status"], work["short"]) == ("not judged", "products not counted")
    assert "no matrix product involved q, k or v as the grader gave them" in work["details"][0]
    assert e["checks"] == {"passed": 12, "failed": 0, "not_run": 0, "not_judged": 1}


@pytest.mark.parametrize("P", [2, 3, 4])
def test_computing_before_sendrecv_fails_the_overlap_check(students, P):
    """The ring exercise asks for the transfer to overlap the compute: Sendrecv_replace after it does not."""
    e = entry(students[2], "compute_then_sendrecv", P)
    overlap = [c for c in e["cases"] if c["case"] == "overlap: sends during compute"][0]["checks"]["output"]
    assert overlap["status"] == "FAIL" and overlap["short"] == "sends overlapped with compute: " + \
        ", ".join([f"0/{P - 1}"] * P), overlap
    assert e["checks"]["failed"] == 1 and any("post comm.Isend/comm.Irecv of the next block before computing" in h
                                              for h in e["hints"])


def test_a_time_limit_abort_still_gives_a_summary_and_the_next_files_are_graded(students):
    code, output, report, _ = students
    for P in (2, 3, 4):
        e = entry(report, "endless_loop", P)
        assert e["aborted"] and "ring_attention has not returned after 6 s (--time-limit)" in e["aborted"], e
        cells = case_cells(e)
        assert list(cells.values())[0] == {"output": "ok", "traffic": "ok", "safety": "ok"}  # the case before
        assert entry(report, "head_parallel", P)["verdict"] == "pass"  # graded by a job started after the abort
    assert "endless_loop.py (forward): FAIL" in output


@pytest.fixture(scope="module")
def solutions(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("solutions")
    return batch(tmp, EXERCISES / "solutions", "2,3,4", "--trace", tmp / "trace.json") + (tmp,)


LABS = {"00_allreduce": "allreduce", "01_merge": "merge", "02_ring": "ring", "03_causal": "causal",
        "04_zigzag": "zigzag", "05_bidirectional": "bidirectional", "06_backward": "backward", "07_ulysses": "ulysses",
        "08_decode": "decode", "09_gqa": "gqa", "10_passq": "passq"}


def test_every_lab_solution_passes_at_every_P(solutions):
    code, output, report, _, _ = solutions
    assert code == 0, output
    got = {(Path(e["file"]).stem, e["P"]): (e["exercise"], e["verdict"]) for e in report["entries"]}
    assert got == {(name, P): (lab, "pass") for name, lab in LABS.items() for P in (2, 3, 4)}


def test_the_solutions_work_and_overlap(solutions):
    report = solutions[2]
    shorts = {c["case"]: c["checks"]["output"]["short"] for name in ("02_ring", "03_causal", "04_zigzag")
              for c in entry(report, name, 3)["cases"] if c["case"].startswith(("work", "overlap"))}
    assert shorts == {"work: causal skipping": "blocks per rank 1, 2, 3 (plan 1, 2, 3)",
                      "work: zigzag balance": "blocks per rank 2, 2, 2 (plan 2, 2, 2), max/min 1",
                      "overlap: sends during compute": "sends overlapped with compute: 4/4, 4/4, 4/4"}


def test_a_students_timeline_is_a_chrome_trace(solutions):
    tmp = solutions[4]
    trace = json.loads((tmp / "trace-02_ring-P3.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert {"rank 0", "rank 2"} <= {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert any(n.startswith("send -> ") for n in names) and "wait" in names and any(n.startswith("block s") for n in
                                                                                     names), names
    assert len(list(tmp.glob("trace-*-P*.json"))) == 3 * len(LABS)


def test_a_students_timeline_is_drawn(tmp_path):
    """--plot draws the student's timeline as ``run --plot`` draws mpiring's own (needs matplotlib)."""
    pytest.importorskip("matplotlib")
    picture = tmp_path / "ring.png"
    code, output, report, _ = batch(tmp_path, EXERCISES / "solutions" / "02_ring.py", "3", "--plot", picture)
    assert code == 0 and picture.stat().st_size > 10_000, output
    assert report["entries"][0]["trace"] == str(picture)


def test_exercise_skeletons_fail(tmp_path):
    code, output, report, _ = batch(tmp_path, EXERCISES, "2")
    assert code == 1, output
    assert len(report["entries"]) == len(LABS)
    for e in report["entries"]:
        assert e["verdict"] == "fail" and e["hints"][0] == "a TODO is left: fill it in", e
        assert "NotImplementedError: " in details(e, "safety")


PLANTED = {  # the new labs' planted wrong versions, at P = 4: the hint each must get
    "allreduce_whole": "a ring all-reduce sends 2 (P - 1) chunks of N/P elements",
    "allreduce_gather_early": "chunk 0 (elements 0..249) on rank 3 holds no part of ranks [1, 2, 3]",
    "ulysses_allgather": "Ulysses moves q, k, v and the output once each with an all-to-all",
    "ulysses_heads": "rank 3's output has its heads in the wrong order (head 1 holds head 2;",
    "decode_gather": "merge as a tree: in round d = 1, 2, 4, ...",
    "decode_nan": "NaN/Inf in the output (rank 3's shard is empty: its lse is -inf)",
    "gqa_repeat_first": "repeat them for the 4 query heads after receiving, not before sending",
    "gqa_tile": "query head h uses K/V head h // 2 (np.repeat(k, 2, axis=-3)); yours uses K/V head h % 2 (np.tile)",
    "passq_kv": "pass-Q: the query blocks travel the ring and each partial (out, lse) goes home once",
    "passq_average": "did you rescale with the log-sum-exp when merging?",
}


def test_the_new_labs_planted_wrong_versions_fail_with_their_hint(tmp_path):
    code, output, report, _ = batch(tmp_path, STUDENTS / "labs", "4")
    assert code == 1, output
    assert sorted(Path(e["file"]).stem for e in report["entries"]) == sorted(PLANTED)
    for e in report["entries"]:
        hint = PLANTED[Path(e["file"]).stem]
        assert e["verdict"] == "fail" and any(h.startswith(hint) or hint in h for h in e["hints"]), (hint, e["hints"])


def test_the_documented_commands_name_existing_files():
    """Every grade command of docs/exercises.md and docs/course.md parses, and its files exist."""
    from mpiring.tools.grade import parser

    commands = [line.split("#")[0] for doc in ("exercises.md", "course.md")
                for line in (ROOT / "docs" / doc).read_text().splitlines()
                if "python -m mpiring grade" in line and line.startswith(("mpiexec", "python"))]
    seen = set()
    for command in commands:
        words = shlex.split(command)
        args = parser().parse_args(words[words.index("grade") + 1:])
        for path in args.students:
            if path.startswith("examples/"):
                assert (ROOT / path).exists(), command
                if path.endswith(".py") and "/solutions/" not in path:
                    assert (ROOT / Path(path).parent / "solutions" / Path(path).name).is_file(), command
                    seen.add(Path(path).stem)
    assert seen >= set(LABS)


def test_the_command_of_python_m_mpiring():
    """``python -m mpiring grade`` under mpiexec is the grader's job."""
    code, output, _ = launch(2, "mpiring", "grade", "--quick", "--timeout", 2, STUDENTS / "correct_sendrecv.py")
    assert code == 0 and "PASS: all" in output, output


def test_the_deadlock_demo():
    code, output, seconds = launch(2, "mpiring", "demo", "deadlock", "--timeout", 1)
    assert code == 0, output
    assert seconds < FAST, output
    assert re.search(r"the eager limit is between the two", output), output
    assert re.search(r"every Send returned before any Recv was posted", output), output
    assert re.search(r"1 MiB: DEADLOCK: no rank's Send returned within 1 s", output), output
    assert re.search(r"Isend \+ Irecv, then Waitall: completed on every rank", output), output
    assert re.search(r"Sendrecv: +completed on every rank", output), output
