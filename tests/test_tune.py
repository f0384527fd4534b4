"""The tuning cache (``python -m mpiring bench tune``): written (tuning.tune), read back (tuning.machine), used.

    python -m pytest -q tests/test_tune.py
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from mpiring.core import backends
from mpiring.core.tiles import default_tiles
from mpiring.core.tuning import gemm, machine, tune


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache file of this test's own; the module's memory of the cache forgotten before and after."""
    path = tmp_path / "tune.json"
    monkeypatch.setenv("MPIRING_TUNE_CACHE", str(path))
    machine.cached.cache_clear()
    gemm.backend.cache_clear()
    backends.backend.cache_clear()
    yield path
    machine.cached.cache_clear()
    gemm.backend.cache_clear()
    backends.backend.cache_clear()


def test_tune_writes_and_the_kernels_read(cache):
    entry = tune.tune(dims=(8,), dtypes=("float32",), seq=64, heads=2, repeats=1, log=lambda *a: None)
    assert entry["gemm"] in gemm.available()
    fwd = tuple(entry["tiles"]["fwd"]["float32"]["8"])
    bwd = tuple(entry["tiles"]["bwd"]["float32"]["8"])
    assert fwd in tune.candidates(np.float32) and bwd in tune.candidates(np.float32)
    data = json.loads(cache.read_text())
    assert list(data) == [machine.machine_key()]
    assert default_tiles(8, np.float32) == fwd and default_tiles(8, np.float32, "bwd") == bwd
    assert default_tiles(64, np.float32) == fwd       # the nearest head dim tuned
    assert default_tiles(8, np.float64) == (256, 256)  # not tuned: the constants
    assert gemm.backend() == entry["gemm"]
    assert "kernel" not in entry  # the kernel backend is not tuned: "auto" follows backends.AUTO_ROWS


def test_cache_keeps_other_machines_and_ignores_theirs(cache):
    cache.write_text(json.dumps({"another CPU": {"gemm": "numpy", "tiles": {"fwd": {"float32": {"64": [64, 64]}}}}}))
    assert machine.cached() == {}
    assert default_tiles(64, np.float32) == (512, 256)
    tune._write({"gemm": "numpy", "tiles": {"fwd": {"float32": {"64": [1024, 128]}}}})
    data = json.loads(cache.read_text())
    assert set(data) == {"another CPU", machine.machine_key()}
    assert default_tiles(64, np.float32) == (1024, 128)


def test_cache_off_and_unreadable(cache, monkeypatch):
    cache.write_text("not json")
    assert machine.cached() == {} and default_tiles(64, np.float32) == (512, 256)
    monkeypatch.setenv("MPIRING_TUNE_CACHE", "off")
    machine.cached.cache_clear()
    assert machine.cache_path() is None and machine.cached() == {}


def test_candidates_fill_the_same_bytes():
    for (q32, k32), (q64, k64) in zip(tune.candidates(np.float32), tune.candidates(np.float64)):
        assert q32 * k32 * 4 == q64 * k64 * 8


def test_command(cache):
    run = subprocess.run([sys.executable, "-m", "mpiring", "bench", "tune", "--dims", "8", "--dtypes", "float32",
                          "--seq", "64", "--heads", "1", "--repeats", "1"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "fastest backend:" in run.stdout and "kernel backend" not in run.stdout and "cached" in run.stdout
    show = subprocess.run([sys.executable, "-m", "mpiring", "bench", "tune", "--show"], capture_output=True,
                          text=True, timeout=120)
    assert show.returncode == 0 and '"gemm"' in show.stdout
    bad = subprocess.run([sys.executable, "-m", "mpiring", "bench", "tune", "--seq", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--seq must be at least 1" in bad.stderr


def test_machine_key_does_not_depend_on_what_is_loaded():
    """The key the cache is written under is the key a later process looks it up by, whether or not it has
    loaded MKL for its GEMMs yet (the GEMM choice, read from the cache, decides that)."""
    import ctypes

    machine.machine_key.cache_clear()
    before = machine.machine_key()
    if machine.mkl_library():
        ctypes.CDLL(machine.mkl_library())
    machine.machine_key.cache_clear()
    assert machine.machine_key() == before
