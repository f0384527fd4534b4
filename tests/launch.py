"""How the tests start MPI jobs: one place, the same flags as run/_env.

    from launch import MPIEXEC, clean_env, mpiexec_argv

    subprocess.run(mpiexec_argv(3, sys.executable, "-m", "mpiring", "run"), env=clean_env())

``mpiexec_argv`` is the mpiexec first on PATH with the flags run/_mpiexec
gives it: ``--oversubscribe`` for Open MPI (the tests start more ranks than a
small machine has cores). ``clean_env`` is this process's environment without
the variables that tie a process to a launch already under way (a test run
under ``mpiexec -n P`` must start a job of its own, not join its parent's), and,
for Open MPI as root, with the two variables that let Open MPI run as root.
tests/test_scripts.py checks that this file and run/_mpiexec agree.
"""

import functools
import os
import re
import shutil
import signal
import subprocess

MPIEXEC = shutil.which("mpiexec")
OPEN_MPI = re.compile(r"open mpi|openrte", re.I)  # "mpiexec (Open MPI) 5.0.3", "mpiexec (OpenRTE) 4.1.4"
ROOT_VARIABLES = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# UCX's TCP fragments of a non-contiguous message, as run/_mpiexec sets them (unless set already)
UCX_SEGMENTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m"}

# Set by a launcher for the job it started: MPICH's Hydra (PMI_RANK, PMI_FD,
# HYDI_CONTROL_FD, MPI_LOCALRANKID, ...), PMIx, the MPIR debugger interface, and
# Open MPI's per-job OMPI_* variables. Open MPI settings a user chooses
# (OMPI_MCA_btl=..., OMPI_ALLOW_RUN_AS_ROOT*) are not among them and stay.
JOB_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS",
                "OMPI_COMM_WORLD_", "OMPI_UNIVERSE_SIZE", "OMPI_APP_CTX_", "OMPI_NUM_APP_CTX",
                "OMPI_FIRST_RANKS", "OMPI_ARGV", "OMPI_COMMAND", "OMPI_FILE_LOCATION",
                "OMPI_MCA_orte_", "OMPI_MCA_ess", "OMPI_MCA_pmix", "OMPI_MCA_initial_wdir",
                "OMPI_MCA_shmem_RUNTIME_QUERY_hint")


def version_text(mpiexec=None):
    """What ``mpiexec --version`` prints ("" without an mpiexec)."""
    mpiexec = mpiexec or MPIEXEC
    if mpiexec is None:
        return ""
    try:
        done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def is_open_mpi(text):
    """Whether ``mpiexec --version`` output ``text`` is Open MPI's (the test of run/_mpiexec)."""
    return bool(OPEN_MPI.search(text))


@functools.cache
def open_mpi():
    """Whether the mpiexec on PATH is Open MPI's."""
    return is_open_mpi(version_text())


def flags(text, uid):
    """(mpiexec flags, variables to set) for ``mpiexec --version`` output ``text`` and user id ``uid``."""
    if not is_open_mpi(text):
        return [], {}
    return ["--oversubscribe"], (dict(ROOT_VARIABLES) if uid == 0 else {})


def mpiexec_argv(n, *args):
    """``[mpiexec, (--oversubscribe,) -n, n, *args]``: the command line run/_env would launch."""
    if MPIEXEC is None:
        raise RuntimeError("no mpiexec on PATH")
    extra, _ = flags("Open MPI" if open_mpi() else "", os.geteuid())
    return [MPIEXEC, *extra, "-n", str(n), *map(str, args)]


def clean_env(environ=None, **extra):
    """A fresh launch's environment: ``environ`` (default os.environ) without a
    parent launch's variables, with UCX's segment sizes unless set, Open MPI's root permission if needed,
    and ``extra``."""
    environ = os.environ if environ is None else environ
    env = {k: v for k, v in environ.items() if not k.startswith(JOB_PREFIXES)}
    for name, value in UCX_SEGMENTS.items():
        env.setdefault(name, value)
    if MPIEXEC is not None and open_mpi():
        env.update(flags("Open MPI", os.geteuid())[1])
    env.update(extra)
    return env


def run_limited(cmd, limit, stderr=subprocess.PIPE, cwd=None, env=None):
    """``(exit code, stdout, stderr)`` of ``cmd`` in a fresh launch environment (``env``, default ``clean_env()``;
    ``stderr=subprocess.STDOUT``: joined to stdout); a job still running after ``limit`` seconds is killed with
    every process it started, and AssertionError says it hung."""
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env or clean_env(), cwd=cwd,
                           start_new_session=True)
    try:
        out, err = job.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, err = job.communicate()
        raise AssertionError(f"job hung (killed after {limit:g} s): {' '.join(cmd)}\n{out}\n{(err or '')[-3000:]}") \
            from None
    return job.returncode, out, err
