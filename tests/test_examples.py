"""The examples run as the README says, and print a checked result.

    python -m pytest -q tests/test_examples.py
"""

import os
import re
import subprocess
import sys

import pytest

from launch import MPIEXEC, clean_env, mpiexec_argv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_readme_shows_the_quickstart_as_it_is():
    readme = open(os.path.join(ROOT, "README.md")).read()
    code = open(os.path.join(ROOT, "examples", "quickstart.py")).read()
    assert code[code.index("import numpy as np"):] in readme


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_quickstart_verifies():
    job = subprocess.run(mpiexec_argv(2, sys.executable, os.path.join(ROOT, "examples", "quickstart.py")),
                         capture_output=True, text=True, env=clean_env(), timeout=120, cwd=ROOT)
    assert job.returncode == 0, job.stdout + job.stderr
    error = float(re.search(r"max \|out - reference\| = (\S+)", job.stdout).group(1))
    assert error < 1e-5
