"""A one-machine Slurm runs ``srun -n 4 python -m mpiring run`` to VERIFIED (run/slurm), when asked.

    MPIRING_SLURM=1 python -m pytest -q tests/test_slurm.py

run/slurm installs Debian's slurm-wlm and munge with apt and starts slurmctld and slurmd as
root: the suite skips it unless MPIRING_SLURM=1 (docs/mpi.md has the combinations as measured).
"""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ASKED = os.environ.get("MPIRING_SLURM") == "1"


@pytest.mark.skipif(not ASKED, reason="starts a Slurm cluster as root (apt-get install slurm-wlm): MPIRING_SLURM=1")
@pytest.mark.skipif(os.name != "posix" or os.geteuid() != 0, reason="run/slurm needs root")
@pytest.mark.skipif(shutil.which("slurmctld") is None and shutil.which("apt-get") is None,
                    reason="neither Slurm nor apt-get to install it")
def test_srun_verifies_with_the_mpich_wheel():
    job = subprocess.run(["bash", os.path.join(ROOT, "run", "slurm"), "wheel"], capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    if job.returncode == 3:
        pytest.skip(f"Slurm cannot start here: {job.stderr.strip().splitlines()[-1:]}")
    assert job.returncode == 0, job.stdout + job.stderr
    assert "srun -n 4 --mpi=pmi2, MPI wheel: VERIFIED (P=4 " in job.stdout, job.stdout
