"""A rank that fails mid-ring: the live ranks raise CommTimeout, never crash (run several times: it was intermittent).

    python -m pytest -q tests/test_abandon.py
"""

import os
import re
import subprocess
import sys

import pytest

from launch import MPIEXEC, clean_env, mpiexec_argv

JOB = os.path.join(os.path.dirname(__file__), "abandon_job.py")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("which", ["forward", "backward"])
# the quick suite runs each once; --full repeats them (the crash they guard against was intermittent)
@pytest.mark.parametrize("repeat", [0, *(pytest.param(r, marks=pytest.mark.full) for r in (1, 2))])
def test_live_ranks_raise_comm_timeout_and_never_crash(which, repeat):
    job = subprocess.run(mpiexec_argv(3, sys.executable, JOB, which), capture_output=True, text=True,
                         env=clean_env(), timeout=60)
    # each rank's line; the launcher may join two ranks' lines when they write at once
    said = sorted(re.findall(r"rank \d+: (?:CommTimeout|RuntimeError|returned|[A-Za-z]+Error)", job.stdout))
    assert said == ["rank 0: CommTimeout", "rank 1: RuntimeError", "rank 2: CommTimeout"], job.stdout + job.stderr
    assert "Segmentation" not in job.stderr and "BAD TERMINATION" not in job.stdout + job.stderr
