"""``python -m mpiring generate`` on every rank of the test job: prefill, decode steps, each verified.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_generate_mpi.py

The command is a function ``(comm, args) -> exit code`` (as mpi4py.bench's);
rank 0 prints the report and must end with VERIFIED. One test (not marked
mpi: the serial run only) starts ``mpiexec -n 2 python -m mpiring generate``
as a user types it.
"""

import subprocess
import sys

import pytest

from mpiring.tools.cli import Agreed
from mpiring.tools.cli_generate import generate

from launch import MPIEXEC, clean_env, mpiexec_argv


@pytest.mark.parametrize("extra", [[], ["--quantize", "int8", "--merge", "ring", "--placement", "contiguous"],
                                   ["--quantize", "float16", "--merge", "tree", "--dtype", "float64", "--rotate", "q",
                                    "--step-tokens", "2"],
                                   ["--speculative", "3", "--interleave", "4", "--merge", "tree"]])
@pytest.mark.mpi
def test_generate_verifies(comm, capsys, extra):
    code = generate(comm, ["--prompt-len", "45", "--new-tokens", "3", "--heads", "4", "--kv-heads", "2",
                           "--dim", "16", *extra])
    assert comm.allgather(code) == [0] * comm.size
    if comm.rank == 0:
        out = capsys.readouterr().out
        assert out.splitlines()[-1].startswith("VERIFIED"), out
        assert "cache bytes per rank" in out and "p95" in out
        assert f"prefill (ring passing {'q' if '--rotate' in extra else 'kv'}, causal)" in out
        assert ("speculative: " in out) == ("--speculative" in extra)
        for merge in ("tree", "ring"):
            assert (f"  {merge} " in out) == (merge in extra or "--merge" not in extra)


@pytest.mark.mpi
def test_generate_needs_a_prompt_token_per_rank(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks")
    with pytest.raises(Agreed, match="shorter than the number of ranks"):
        generate(comm, ["--prompt-len", "1", "--new-tokens", "1", "--heads", "2", "--dim", "8"])


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_generate_as_a_user_types_it():
    """Under mpiexec: VERIFIED once (rank 0), exit 0; a bad option: exit 2 before MPI starts."""
    argv = mpiexec_argv(2, sys.executable, "-m", "mpiring", "generate", "--prompt-len", "64", "--new-tokens", "2",
                        "--heads", "4", "--kv-heads", "2", "--dim", "16", "--quantize", "int8")
    job = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=clean_env())
    assert job.returncode == 0 and job.stdout.count("VERIFIED") == 1, job.stdout + job.stderr
    bad = subprocess.run(argv[:-2] + ["--kv-heads", "3"], capture_output=True, text=True, timeout=120,
                         env=clean_env())
    assert bad.returncode == 2 and "--heads 4 must be a multiple of --kv-heads 3" in bad.stderr, bad.stderr
