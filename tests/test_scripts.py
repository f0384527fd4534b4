"""The run/ scripts and tests/launch.py: how jobs are launched, with which MPI and flags.

    python -m pytest -q tests/test_scripts.py
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import launch
from launch import MPIEXEC, clean_env, mpiexec_argv

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "run"
TUTORIAL = ROOT / "docs" / "tutorial.md"

# what `mpiexec --version` prints, first lines
VERSIONS = {
    "open mpi 5": "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
    "open mpi 4, debian 12": "mpiexec (OpenRTE) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/\n",
    "mpich": "HYDRA build details:\n    Version:                                 4.2.0\n",
    "intel mpi": "Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619\n",
}


def _source_mpiexec(tmp_path, version, uid):
    """Source run/_mpiexec with a fake mpiexec printing ``version`` and a fake ``id -u``."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    (bin_ / "mpiexec").write_text(f"#!/bin/sh\ncat <<'EOF'\n{version}EOF\n")
    (bin_ / "id").write_text(f"#!/bin/sh\necho {uid}\n")
    for name in ("mpiexec", "id"):
        (bin_ / name).chmod(0o755)
    script = f'source "{RUN}/_mpiexec"; printf "%s\\n" "${{MPIEXEC[*]}}" "$MPIRING_OPEN_MPI" ' \
             '"${OMPI_ALLOW_RUN_AS_ROOT:-}" "${OMPI_ALLOW_RUN_AS_ROOT_CONFIRM:-}"'
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["PATH"] = f"{bin_}:{env['PATH']}"
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    command, open_mpi, root, confirm = done.stdout.splitlines()
    return command.split(), open_mpi == "1", {k: v for k, v in (("OMPI_ALLOW_RUN_AS_ROOT", root),
                                                                 ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", confirm)) if v}


@pytest.mark.parametrize("uid", [0, 1000])
@pytest.mark.parametrize("name", sorted(VERSIONS))
def test_run_env_and_launch_agree_on_flags(tmp_path, name, uid):
    """run/_mpiexec (for run/test, run/demo, run/bench) and tests/launch.py: the same decision."""
    command, open_mpi, variables = _source_mpiexec(tmp_path, VERSIONS[name], uid)
    flags, want_variables = launch.flags(VERSIONS[name], uid)
    assert open_mpi == name.startswith("open mpi") == launch.is_open_mpi(VERSIONS[name])
    assert command == ["mpiexec", *flags]
    assert variables == want_variables
    if open_mpi:
        assert flags == ["--oversubscribe"]
        assert variables == ({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"} if uid == 0 else {})
    else:
        assert flags == [] and variables == {}


@pytest.mark.parametrize("given", [None, "64k"])
def test_run_env_and_launch_agree_on_ucx_segments(given):
    """UCX's TCP segment sizes: set where MPI is started (run/_mpiexec, tests/launch.py), a value given kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_TCP_")}
    if given:
        env["UCX_TCP_TX_SEG_SIZE"] = given
    done = subprocess.run(["bash", "-c", f'source "{RUN}/_mpiexec"; printf "%s\\n" "$UCX_TCP_TX_SEG_SIZE" '
                           '"$UCX_TCP_RX_SEG_SIZE"'], capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    tx, rx = done.stdout.splitlines()
    launched = clean_env(env)
    assert (tx, rx) == (launched["UCX_TCP_TX_SEG_SIZE"], launched["UCX_TCP_RX_SEG_SIZE"]) == (given or "1m", "1m")


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_launch_uses_the_mpiexec_on_path_as_run_env_does():
    done = subprocess.run(["bash", "-c", f'source "{RUN}/_mpiexec"; printf "%s\\n" "${{MPIEXEC[@]}}"'],
                          capture_output=True, text=True, timeout=30)
    flags = done.stdout.split()[1:]
    assert mpiexec_argv(3, "python", "x.py") == [MPIEXEC, *flags, "-n", "3", "python", "x.py"]
    if launch.open_mpi() and os.geteuid() == 0:
        assert clean_env({})["OMPI_ALLOW_RUN_AS_ROOT"] == "1"


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_mpiexec_on_path_is_the_mpi_of_mpi4py():
    """Nothing shadows the wrong way: with the mpich wheel, its Hydra mpiexec comes first on PATH;
    with a system Open MPI (run/test --mpi system), Open MPI's."""
    from mpi4py import MPI

    vendor = MPI.get_vendor()[0]
    assert launch.open_mpi() == (vendor == "Open MPI"), (MPIEXEC, launch.version_text(), vendor)
    if Path(sys.prefix).resolve() == (ROOT / ".venv-system").resolve():
        assert not Path(MPIEXEC).resolve().is_relative_to((ROOT / ".venv").resolve()), MPIEXEC


def test_clean_env_drops_a_parent_launch_and_keeps_settings():
    parent = {
        "PATH": "/usr/bin", "HOME": "/root", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        "OMPI_MCA_btl": "self,vader", "OMPI_MCA_btl_vader_single_copy_mechanism": "none",  # a user's settings
        # MPICH's Hydra
        "PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "9", "HYDI_CONTROL_FD": "7", "MPI_LOCALRANKID": "0",
        "MPI_LOCALNRANKS": "2", "HYDRA_LAUNCHER": "fork", "MPIR_CVAR_CH4_NETMOD": "ofi",
        # Open MPI 4 (ORTE) and PMIx
        "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_MCA_orte_hnp_uri": "123.0;tcp://127.0.0.1:4000", "OMPI_MCA_ess": "^singleton",
        "OMPI_MCA_ess_base_jobid": "123", "OMPI_MCA_pmix": "^s1,s2,cray,isolated", "OMPI_UNIVERSE_SIZE": "2",
        "OMPI_FIRST_RANKS": "0", "OMPI_APP_CTX_NUM_PROCS": "2", "OMPI_NUM_APP_CTX": "1",
        "PMIX_RANK": "0", "PMIX_NAMESPACE": "123",
    }
    env = clean_env(parent, EXTRA="yes")
    kept = {"PATH", "HOME", "OMPI_ALLOW_RUN_AS_ROOT", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "OMPI_MCA_btl",
            "OMPI_MCA_btl_vader_single_copy_mechanism", "EXTRA", "UCX_TCP_TX_SEG_SIZE", "UCX_TCP_RX_SEG_SIZE"}
    assert set(env) == kept
    assert env["OMPI_ALLOW_RUN_AS_ROOT"] == "1" and env["EXTRA"] == "yes"


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_a_job_started_from_inside_a_job_is_a_job_of_its_own(tmp_path):
    """A test run under mpiexec that launches mpiexec (clean_env) starts a fresh 2-rank job."""
    inner = tmp_path / "inner.py"
    inner.write_text("from mpi4py import MPI\nc = MPI.COMM_WORLD\nprint(f'inner {c.rank}/{c.size}')\n")
    outer = tmp_path / "outer.py"
    outer.write_text(
        "import subprocess, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from launch import clean_env, mpiexec_argv\n"
        f"done = subprocess.run(mpiexec_argv(2, sys.executable, {str(inner)!r}), env=clean_env(),\n"
        "                      capture_output=True, text=True, timeout=60)\n"
        "print(done.stdout, done.stderr)\n"
        "sys.exit(done.returncode)\n")
    done = subprocess.run(mpiexec_argv(1, sys.executable, outer), capture_output=True, text=True, timeout=120,
                          env=clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(re.findall(r"inner \d/\d", done.stdout)) == ["inner 0/2", "inner 1/2"], done.stdout


def test_pytest_mpi_banner_only_where_wanted(tmp_path):
    """run/test prints pytest-mpi's "MPI Information" once: its mpiexec runs load run/_no_mpi_banner.py."""
    pytest.importorskip("pytest_mpi")
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    env = dict(os.environ, PYTHONPATH=str(RUN))
    cmd = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider", str(tmp_path)]
    with_banner = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    without = subprocess.run(cmd + ["-p", "_no_mpi_banner"], capture_output=True, text=True, timeout=120, env=env,
                             cwd=tmp_path)
    assert with_banner.returncode == 0 and without.returncode == 0, with_banner.stdout + without.stdout
    assert "MPI Information" in with_banner.stdout and "MPI vendor" in with_banner.stdout
    assert "MPI Information" not in without.stdout and "1 passed" in without.stdout


# ---------------------------------------------------------------- run/demo and run/figures

def _script_env():
    """The environment to run a run/ script in, so that its run/_env picks this interpreter's
    virtual environment (and never makes one): skip the test otherwise."""
    for mpi, venv in (("wheel", ".venv"), ("system", ".venv-system")):
        if Path(sys.prefix).resolve() == (ROOT / venv).resolve():
            return dict(os.environ, MPIRING_MPI=mpi)
    pytest.skip("not running in the checkout's .venv or .venv-system, which run/ scripts would use")


def _dry(script, *args, var):
    done = subprocess.run([str(RUN / script), *args], capture_output=True, text=True, timeout=120,
                          env=dict(_script_env(), **{var: "1"}))
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _mpiring_argv(line):
    """The ``python -m mpiring run ...`` options of a printed mpiexec line."""
    return line.split(" -m mpiring run ", 1)[1].split()


@pytest.mark.parametrize("args, ranks, want", [
    ([], 4, "--seq-len 4096 --dim 64 --heads 8 --causal --layout zigzag"),
    (["-n", "2", "--seq-len", "8192", "--heads", "4"], 2,
     "--seq-len 4096 --dim 64 --heads 8 --causal --layout zigzag --seq-len 8192 --heads 4"),
    (["--layout", "striped"], 4, "--seq-len 4096 --dim 64 --heads 8 --causal --layout zigzag --layout striped"),
    (["-n", "3", "--no-defaults", "--seq-len", "99"], 3, "--seq-len 99"),
    (["--seq-len", "99", "--no-defaults"], 4, "--seq-len 99"),
])
def test_demo_adds_options_to_its_defaults(args, ranks, want):
    out = _dry("demo", *args, var="MPIRING_DEMO_DRY_RUN")
    line = out.splitlines()[-1]
    assert f" -n {ranks} python -m mpiring run " in line
    assert _mpiring_argv(line) == want.split()


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_demo_runs_with_the_defaults_overridden():
    """The options given win, and the defaults not overridden (causal, zigzag) stay."""
    done = subprocess.run([str(RUN / "demo"), "-n", "2", "--seq-len", "64", "--dim", "8", "--heads", "2"],
                          capture_output=True, text=True, timeout=120, env=clean_env(_script_env()))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "P=2 seq_len=64 batch=1 heads=2 kv_heads=2 dim=8 float32 causal=True layout=zigzag" in done.stdout
    assert done.stdout.count("VERIFIED") == 1


def test_figures_are_drawn_by_the_tutorial_commands():
    """run/figures runs the tutorial's picture commands, with docs/img/ where the tutorial has /tmp/mpiring-,
    and so draws every picture the tutorial shows."""
    out = _dry("figures", var="MPIRING_FIGURES_DRY_RUN")
    text = TUTORIAL.read_text()
    tutorial = [_mpiring_argv(line) for line in text.splitlines()
                if line.startswith("mpiexec ") and "--plot /tmp/mpiring-" in line]
    figures = [_mpiring_argv(line.replace("docs/img/", "/tmp/mpiring-")) for line in out.splitlines()
               if line.startswith("+ ") and " -m mpiring run " in line]
    assert figures == tutorial and len(tutorial) == 6
    call = re.search(r"^plot_step_time\(.*?\)$", text, re.S | re.M).group(0)
    assert call.replace("/tmp/mpiring-", "docs/img/") in out
    shown = set(re.findall(r"\]\(img/([^)]+)\)", text))
    drawn = set(re.findall(r"docs/img/(\S+?\.png)", out))
    assert shown == drawn


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_figures_draws_every_picture(tmp_path):
    """A real run/figures, into a temporary directory (MPIRING_FIGURES_DIR) instead of docs/img/."""
    pytest.importorskip("matplotlib", reason="no matplotlib")
    shown = set(re.findall(r"\]\(img/([^)]+)\)", TUTORIAL.read_text()))
    before = {name: (ROOT / "docs" / "img" / name).read_bytes() for name in shown}
    done = subprocess.run([str(RUN / "figures")], capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
                          env=clean_env(_script_env(), MPIRING_FIGURES_DIR=str(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert {p.name for p in tmp_path.iterdir() if p.stat().st_size > 1000} == shown
    assert before == {name: (ROOT / "docs" / "img" / name).read_bytes() for name in shown}
