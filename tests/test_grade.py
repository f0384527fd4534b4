"""The grader: correct rings pass; defective ones fail with the right hint, and nothing hangs.

    python -m pytest --with-mpi -q tests/test_grade.py

Every test launches ``mpiexec -n P python -m mpiring.tools.grade ...`` (or the deadlock demo) as
a subprocess with a clean MPI environment and a hard time limit; a launch that overruns it is
killed with its whole process group and fails the test. The defective rings are in
tests/students/, the exercises in examples/exercises/ (skeletons must fail, solutions pass).
A defect whose report does not depend on the number of ranks is graded at one P; the correct
ring, the causal mask and the work checks at several. The work checks count products (no timing),
so their verdicts are the same on every run, however loaded the machine.
"""

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


def grade(P, student, *options):
    code, output, seconds = launch(P, "mpiring.tools.grade", "--quick", "--timeout", 2, *options, student)
    assert seconds < FAST, f"took {seconds:.1f} s\n{output}"
    return code, output


@pytest.mark.parametrize("P", [2, 3, 4])
def test_a_correct_ring_passes(P):
    code, output = grade(P, STUDENTS / "correct_sendrecv.py")
    assert code == 0, output
    assert "PASS: all 12 checks passed" in output
    assert output.count("output ok") == 4 and output.count("traffic ok") == 4 and output.count("safety ok") == 4


@pytest.mark.parametrize("P", [3])
def test_blocking_sends_deadlock_and_are_reported_as_unsafe(P):
    code, output = grade(P, STUDENTS / "blocking_send.py")
    assert code == 1, output
    assert re.search(r"unsafe: rank 0 blocked in Send to rank 1 \(tag 0, [0-9.]+ KiB\) for 2\.\d s — every rank "
                     r"sends before it receives; use Isend/Irecv or Sendrecv", output), output
    for r in range(1, P):
        assert f"rank {r} blocked in Send to rank {(r + 1) % P}" in output
    assert "stopped: the remaining 3 cases are not run" in output
    assert "FAIL: 0 of 12 checks passed, 1 failed, 11 not run" in output


@pytest.mark.parametrize("P", [3])
def test_a_merge_without_rescale_is_named(P):
    code, output = grade(P, STUDENTS / "no_rescale.py")
    assert code == 1, output
    assert "did you rescale with the log-sum-exp when merging?" in output
    # averaging P blocks: weights 1/P where the log-sum-exp rule gives others
    weights = " + ".join(f"{1 / P:.2f} O{s}" for s in range(P))
    assert f"your output is {weights}" in output
    assert "traffic ok" in output and "traffic FAIL" not in output and "safety FAIL" not in output


@pytest.mark.parametrize("P", [2, 4])
def test_a_causal_mask_off_by_one_block_is_named(P):
    code, output = grade(P, STUDENTS / "causal_off_by_one.py")
    assert code == 1, output
    assert "causal mask off by one block?" in output
    last = P - 1
    assert (f"rank {last}'s output is exactly attention in which rank {last - 1}'s K/V block is masked with the "
            f"causal triangle (np.tril of the block) (it must be attended in full); rank {last}'s K/V block is "
            f"attended in full") in output
    for line in output.splitlines():  # the non-causal cases are right
        if line.startswith("[") and "non-causal" in line:
            assert "output ok" in line, line
        elif line.startswith("["):
            assert "output FAIL" in line, line


@pytest.mark.parametrize("P", [3])
def test_sending_kv_twice_breaks_the_cost_model(P):
    code, output = grade(P, STUDENTS / "kv_twice.py")
    assert code == 1, output
    assert "you send K/V more than P - 1 times" in output
    assert f"2 x the cost model: (P - 1) = {P - 1} K/V blocks per rank, i.e. 2 (P - 1) = {2 * (P - 1)} messages" \
        in output
    assert output.count("traffic FAIL") == 4 and "output FAIL" not in output


def test_a_receive_from_the_wrong_rank_is_caught_in_waitall():
    """MPI.Request.Waitall (through the student's MPI name) is timed too, and says who waited for whom."""
    code, output = grade(3, STUDENTS / "wrong_source.py")
    assert code == 1, output
    assert re.search(r"rank 0 waited 2\.\d s in Waitall", output), output
    assert "Irecv from rank 1 (tag 0" in output
    assert "a rank waits for a message nobody sends it" in output


EXERCISE_FILES = {"merge": "01_merge", "ring": "02_ring", "causal": "03_causal", "zigzag": "04_zigzag",
                  "bidirectional": "05_bidirectional", "backward": "06_backward"}


@pytest.mark.parametrize("exercise", list(EXERCISE_FILES))
def test_exercise_skeletons_fail(exercise):
    code, output = grade(2, EXERCISES / f"{EXERCISE_FILES[exercise]}.py", "--exercise", exercise)
    assert code == 1, output
    assert "a TODO is left: fill it in" in output
    assert "NotImplementedError: exercise" in output


@pytest.mark.parametrize("exercise", list(EXERCISE_FILES))
def test_exercise_solutions_pass(exercise):
    code, output = grade(3, EXERCISES / "solutions" / f"{EXERCISE_FILES[exercise]}.py", "--exercise", exercise)
    assert code == 0, output
    assert "PASS: all" in output
    if exercise == "causal":
        assert "work: causal skipping: ok (blocks per rank 1, 2, 3 (plan 1, 2, 3))" in output, output
    if exercise == "zigzag":
        assert "work: zigzag balance: ok (blocks per rank 2, 2, 2 (plan 2, 2, 2), max/min 1)" in output, output


@pytest.mark.parametrize("P", [2, 4])
def test_causal_work_without_skipping_fails(P):
    """Counted products: rank 0 computed P blocks where it needs 1, on every run."""
    code, output = grade(P, STUDENTS / "no_skip.py", "--exercise", "causal")
    assert code == 1, output
    blocks = ", ".join([str(P)] * P)
    plan = ", ".join(str(r + 1) for r in range(P))
    assert f"work: causal skipping: FAIL (blocks per rank {blocks} (plan {plan}))" in output, output
    assert (f"hint: rank 0 computed {P} blocks where it needs 1 (its own block): skip the blocks that lie entirely "
            f"after a rank's queries") in output
    assert "FAIL: 12 of 13 checks passed, 1 failed, 0 not run" in output


@pytest.mark.parametrize("P", [2, 3])
def test_zigzag_work_with_whole_blocks_fails(P):
    """Balanced, but every off-diagonal block computed whole: judged at P = 2 too, where timing could not tell."""
    code, output = grade(P, STUDENTS / "zigzag_no_skip.py", "--exercise", "zigzag")
    assert code == 1, output
    plan = ", ".join([f"{1 + (P - 1) / 2:g}"] * P)
    assert f"work: zigzag balance: FAIL (blocks per rank {', '.join([str(P)] * P)} (plan {plan}), max/min 1)" \
        in output, output
    assert "with zigzag shards each off-diagonal block is half visible; compute only the visible half" in output


def test_uncountable_products_are_not_judged():
    """q, k, v made plain arrays (np.array): the work check says so, and the grade still passes."""
    code, output = grade(2, STUDENTS / "plain_arrays.py", "--exercise", "causal")
    assert code == 0, output
    assert "work: causal skipping: not judged (products not counted)" in output
    assert "no matrix product involved q, k or v as the grader gave them" in output
    assert "PASS: all 12 checks passed (1 not judged)" in output


def test_the_documented_commands_name_existing_files():
    """Every grade command of docs/exercises.md parses, and its file exists (skeleton and solution)."""
    from mpiring.tools.grade import parser

    commands = [line for line in (ROOT / "docs" / "exercises.md").read_text().splitlines()
                if line.startswith("mpiexec") and "python -m mpiring grade" in line]
    assert len(commands) == 8
    seen = set()
    for command in commands:
        words = shlex.split(command)
        args = parser().parse_args(words[words.index("grade") + 1:])
        seen.add(args.exercise)
        if args.student.startswith("examples/"):
            assert (ROOT / args.student).is_file(), command
            solution = Path(args.student).parent / "solutions" / Path(args.student).name
            assert (ROOT / solution).is_file(), command
    assert seen == set(EXERCISE_FILES) | {"forward"}


def test_the_commands_of_python_m_mpiring():
    """``python -m mpiring grade`` and ``python -m mpiring demo deadlock`` are the same tools."""
    code, output, _ = launch(2, "mpiring", "grade", "--quick", "--timeout", 2, STUDENTS / "correct_sendrecv.py")
    assert code == 0 and "PASS: all" in output, output
    code, output, _ = launch(2, "mpiring", "demo", "deadlock", "--timeout", 1)
    assert code == 0 and re.search(r"Sendrecv: +completed on every rank", output), output


def test_the_deadlock_demo():
    code, output, seconds = launch(2, "mpiring.tools.deadlock", "--timeout", 1)
    assert code == 0, output
    assert seconds < FAST, output
    assert re.search(r"the eager limit is between the two", output), output
    assert re.search(r"every Send returned before any Recv was posted", output), output
    assert re.search(r"1 MiB: DEADLOCK: no rank's Send returned within 1 s", output), output
    assert re.search(r"Isend \+ Irecv, then Waitall: completed on every rank", output), output
    assert re.search(r"Sendrecv: +completed on every rank", output), output
