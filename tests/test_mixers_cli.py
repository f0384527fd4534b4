"""``python -m mpiring run --mixer``: every mixer verified against the float64 recurrence, and a wrong result caught.

    python -m pytest -q tests/test_mixers_cli.py
"""

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from mpiring.tools import cli_mixers
from mpiring.tools.cli_run import run

from launch import MPIEXEC, clean_env, mpiexec_argv

SMALL = ["--seq-len", "40", "--heads", "2", "--dim", "4", "--state", "3", "--dtype", "float64", "--threads", "1"]


@pytest.mark.parametrize("mixer", cli_mixers.MIXERS)
def test_each_mixer_verifies_on_one_rank(mixer, capsys):
    assert run(MPI.COMM_SELF, ["--mixer", mixer, "--backward", "--cu-seqlens", "0", "9", "40", *SMALL]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[-1] == "VERIFIED" and "bwd bytes" in text


def test_a_wrong_result_fails_verification(monkeypatch, capsys):
    """The verifier can fail: a mixer whose output is off by 1e-6 is reported, with exit code 1."""
    real = cli_mixers.linear_attention

    def off(*args, **kwargs):
        out, carry = real(*args, **kwargs)
        return out + 1e-6, carry

    monkeypatch.setattr(cli_mixers, "linear_attention", off)
    assert run(MPI.COMM_SELF, ["--mixer", "gdn", *SMALL]) == 1
    text = capsys.readouterr().out
    assert "FAILED out is off by 1e-06" in text and text.splitlines()[-1] == "VERIFICATION FAILED"


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("args", [["--mixer", "gdn", "--layout", "zigzag", "--passing", "scan"],
                                  ["--mixer", "ssd", "--layout", "striped", "--passing", "ring"],
                                  ["--mixer", "conv", "--layout", "zigzag", "--width", "5"]])
def test_run_mixer_under_mpiexec(args):
    cmd = mpiexec_argv(3, sys.executable, "-m", "mpiring", "run", *args, "--backward", *SMALL)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("VERIFIED") == 1 and result.stdout.splitlines()[-1] == "VERIFIED"
    rows = [line.split() for line in result.stdout.splitlines() if line[:4].strip() in ("0", "1", "2")]
    assert len(rows) == 3 and all(r[1] == r[2] and r[3] == r[4] for r in rows)  # bytes as the model says
    assert np.sum([int(r[1]) for r in rows]) > 0


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_bench_mixer_rows_run(capsys):
    """``bench mixers``' rows on one rank at a small size: mpiring timed, transformers' peer timed in its child
    process, the bytes as the model says (none move on one rank)."""
    from mpiring.tools.bench.hybrid import mixer_rows

    rows = mixer_rows(MPI.COMM_SELF, repeats=1, budget=1.0, rows=[("ssd", 64)])
    assert [r["mixer"] for r in rows] == ["ssd"]
    assert rows[0]["fwd_s"] > 0 and rows[0]["torch_fwd_s"] and rows[0]["torch_fwdbwd_s"] and rows[0]["bytes_match"]
    text = capsys.readouterr().out
    assert text.startswith("sequence mixers: ") and "float32" in text.splitlines()[0]
    assert text.count("fwd+bwd") == 2  # the row as it finishes, then the table
