"""The benchmark's quick mode: columns, sane numbers, bytes equal to the cost model.

No timing assertions: speed targets live in the benchmark's output (docs/performance.md).
"""

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time

import pytest

from mpiring.cost.memory import memory_model
from mpiring.tools import bench
from mpiring.tools.bench import table
from mpiring.tools.bench.peers import torch_available, torch_times
from mpiring.tools.bench.probes import spinner_pids
from mpiring.tools.bench.sheet import COLUMNS, format_table, format_targets, read_csv, write_csv
from mpiring.tools.bench.table import Config

from launch import MPIEXEC, clean_env, mpiexec_argv, open_mpi

TINY = ["--quick", "--sizes", "256", "--dims", "16", "--heads", "2", "--repeats", "2", "--budget", "5"]


def _check_rows(rows, size, fresh=True):
    """``fresh``: the rows come from a new interpreter, whose RSS only grows past its baseline."""
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok, rows
    for row in ok:
        assert row["P"] == size and row["S"] == 256 and row["D"] == 16 and row["H"] == 2
        assert row["wall_s"] > 0 and row["gflops"] > 0 and row["limit_s"] > 0 and row["compute_s"] > 0
        assert 0 <= row["exposed_comm"] <= 1
        assert row["bytes_match"] == 1 and row["bytes_sent"] == row["bytes_predicted"]
        assert (row["bytes_sent"] > 0) == (size > 1)
        assert row["peak_rss_mb"] > 0 and row["baseline_mb"] > 0 and row["model_mb"] > 0
        if fresh:  # in-process, memory freed by earlier tests can leave the peak below the start RSS
            assert row["peak_rss_mb"] > row["baseline_mb"]
        assert row["blas_threads"] == 1
    assert {r["pass"] for r in ok} <= {"fwd", "fwd+bwd"}
    assert {r["causal"] for r in ok} == {0, 1}
    assert {r["layout"] for r in ok if r["causal"]} == {"zigzag"}


def test_quick_bench_in_process(tmp_path, capsys):
    from mpi4py import MPI

    path = tmp_path / "p1.csv"
    assert bench.bench(MPI.COMM_SELF, TINY + ["--no-torch", "--csv", str(path)]) == 0
    text = capsys.readouterr().out
    assert "BLAS:" in text and "limit, one core" in text and "GFLOP/s" in text
    rows = read_csv(path)
    with open(path) as f:
        assert f.readline().strip().split(",") == COLUMNS
    bf16 = importlib.util.find_spec("ml_dtypes") is not None
    assert len(rows) == 5 + bf16  # full and causal, forward and forward+backward; causal forward bf16, int8 wire
    assert [r["precision"] for r in rows if r["precision"] != "fp32"] == ["bf16"] * bf16 + ["int8w"]
    _check_rows(rows, 1, fresh=False)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_quick_bench_two_ranks_against_baseline(tmp_path):
    from mpi4py import MPI

    p1 = tmp_path / "p1.csv"
    assert bench.bench(MPI.COMM_SELF, TINY + ["--no-torch", "--csv", str(p1)]) == 0
    both = tmp_path / "both.csv"
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "bench", *TINY, "--no-torch",
                       "--baseline", p1, "--csv", both)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    rows = read_csv(both)
    _check_rows([r for r in rows if r["P"] == 2], 2)
    assert len([r for r in rows if r["P"] == 1]) == len([r for r in rows if r["P"] == 2])  # the baseline rows stay
    sent = {r["precision"]: r["bytes_sent"] for r in rows if r["P"] == 2 and r["pass"] == "fwd" and r["causal"]}
    assert sent["int8w"] * 4 * 16 == sent["fp32"] * (16 + 4)  # 1 byte per element and a 4-byte scale per row
    if "bf16" in sent:
        assert 2 * sent["bf16"] == sent["fp32"]
    for row in rows:
        if row["P"] == 2 and row["status"] == "ok":
            assert row["efficiency"] > 0
    assert result.stdout.count("wrote ") == 1  # only rank 0 reports


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_p1_and_load_in_one_run_leave_no_spinner(tmp_path):
    """--p1: each row again on rank 0 alone right after it; efficiency = that time / (P x the row's), no baseline.
    --load 1: every row timed again with a busy process beside it, which is gone when the job ends. One job."""
    before = set(spinner_pids())
    path = tmp_path / "loaded.csv"
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "bench", *TINY, "--no-torch", "--precisions", "fp32",
                       "--p1", "--load", "1", "--csv", path)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert not set(spinner_pids()) - before  # killed and reaped by rank 0, not left spinning
    rows = read_csv(path)
    _check_rows(rows, 2)
    assert all(r["load"] == 1 and r["wall_loaded_s"] > 0 for r in rows)
    assert "wall@L" in result.stdout and "x torch@L" in result.stdout and "1 busy background" in result.stdout
    ok = [r for r in rows if r["status"] == "ok"]
    assert ok and all(r["P"] == 2 for r in ok)
    for row in ok:
        assert row["p1_s"] > 0
        assert row["efficiency"] == pytest.approx(row["p1_s"] / (2 * row["wall_s"]), rel=1e-3)


@pytest.mark.skipif(MPIEXEC is None or not os.path.isdir("/proc"), reason="no mpiexec on PATH, or no /proc")
def test_interrupted_under_load_leaves_no_spinner():
    """Ctrl-C passed on by mpiexec while a row runs loaded: the ranks exit 130 (C's exit(): no finally, no
    Python atexit), and the spinner, orphaned, leaves by itself. ``--budget 2``: each of the row's two timings
    (idle, then loaded) lasts about 2 s, long enough to be interrupted, however slow the machine."""
    before = set(spinner_pids())
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "bench", "--sizes", "2048", "--dims", "64", "--mask",
                       "full", "--passes", "fwd", "--precisions", "fp32", "--repeats", "20", "--budget", "2",
                       "--load", "1", "--no-torch", "--inference", "off")
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=clean_env(),
                           start_new_session=True)
    try:
        end = time.perf_counter() + 120
        while not set(spinner_pids()) - before and time.perf_counter() < end and job.poll() is None:
            time.sleep(0.05)
        assert set(spinner_pids()) - before, "the loaded row never started"
        time.sleep(0.3)
        os.kill(job.pid, signal.SIGINT)  # mpiexec alone, which passes it to the ranks
        # Open MPI's mpirun exits 1 itself when the ranks end on SIGINT, whatever their codes (test_cli_errors)
        assert job.wait(timeout=60) == (1 if open_mpi() else 130), job.stderr.read()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
        job.communicate()
    end = time.perf_counter() + 5
    while set(spinner_pids()) - before and time.perf_counter() < end:
        time.sleep(0.05)
    assert not set(spinner_pids()) - before


def test_torch_is_timed_beside_each_row_idle_and_under_the_same_load(monkeypatch, tmp_path, capsys):
    """torch runs right after each fp32 row (the machine's speed drifts), then again beside the same busy load."""
    from mpi4py import MPI

    events, loaded = [], []

    @contextlib.contextmanager
    def fake_load(n):
        loaded.append(n)
        yield []
        loaded.pop()

    real_run = table.run_config

    def run_config(comm, cfg, **kw):
        events.append(("ring", cfg.name, cfg.causal, cfg.precision, bool(loaded)))
        return real_run(comm, cfg, **kw)

    def torch_times(configs, threads, **kw):
        (cfg,) = configs
        events.append(("torch", cfg.name, cfg.causal, cfg.precision, bool(loaded), threads))
        return [7.0 if loaded else 3.0]

    def context_parallel_times(configs, ranks):
        events.append(("context parallel", len(configs), ranks))
        return [(None, "NotImplementedError: no sharding strategy")] * len(configs)

    monkeypatch.setattr(table, "busy_load", fake_load)
    monkeypatch.setattr(table, "run_config", run_config)
    monkeypatch.setattr(table, "torch_times", torch_times)
    monkeypatch.setattr(table, "context_parallel_times", context_parallel_times)
    monkeypatch.setattr(table, "torch_available", lambda: True)
    path = tmp_path / "rows.csv"
    assert bench.bench(MPI.COMM_SELF, TINY + ["--load", "1", "--precisions", "fp32", "--csv", str(path)]) == 0
    printed = capsys.readouterr().out
    assert [e for e in events if e[0] == "context parallel"] == [("context parallel", 1, 1)] * 4  # after each row
    events = [e for e in events if e[0] != "context parallel"]
    # each row: ring, torch, ring under load, torch under load (P = 1: torch's one thread is the torch1 column)
    assert len(events) == 4 * 4
    for i in range(0, len(events), 4):
        ring, torch, ring_l, torch_l = events[i:i + 4]
        assert ring[0] == "ring" and torch[0] == "torch" and ring_l[0] == "ring" and torch_l[0] == "torch"
        assert ring[1:4] == torch[1:4] == ring_l[1:4] == torch_l[1:4]
        assert (ring[4], torch[4], ring_l[4], torch_l[4]) == (False, False, True, True)
        assert torch[5] == torch_l[5] == 1
    for row in read_csv(path):  # the CSV keeps a few significant digits
        assert row["torch_s"] == 3.0 and row["vs_torch"] == pytest.approx(3.0 / row["wall_s"], rel=1e-3)
        assert row["torch1_s"] == 3.0 and row["kernel"] in ("numpy", "torch")
        assert row["cp_error"] == "NotImplementedError: no sharding strategy" and row["cp_s"] == ""
        assert row["torch_loaded_s"] == 7.0
        assert row["vs_torch_loaded"] == pytest.approx(7.0 / row["wall_loaded_s"], rel=1e-3)
        assert row["load_drop"] == pytest.approx(row["vs_torch"] - row["vs_torch_loaded"], rel=1e-3, abs=1e-3)
    assert printed.count("failed: NotImplementedError: no sharding strategy") == 4  # the error, in the table's place
    assert "CPU: " in printed and "kernel backend " in printed


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_negative_load_is_refused_on_every_rank():
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "bench", "--quick", "--load", "-1")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 2 and result.stderr.count("--load must be at least 0, got -1") == 1, result.stderr


def test_negative_load_is_refused_in_process(capsys):
    from mpi4py import MPI

    with pytest.raises(SystemExit) as exc:
        bench.bench(MPI.COMM_SELF, ["--quick", "--load", "-1"])
    assert exc.value.code == 2 and "--load must be at least 0, got -1" in capsys.readouterr().err


def _target_row(name, causal, **values):
    row = {"P": 2, "S": 16384, "D": 64, "H": 8, "B": 1, "causal": causal, "pass": name, "precision": "fp32",
           "status": "ok", "wall_s": 2.0, "torch_gflops": 150.0}
    row.update(values)
    return row


def _target_line(text, name, mask):
    return next(line for line in text.splitlines() if line.split(":")[0].split() == [name, mask])


def test_targets_against_the_goals():
    """x torch 1.15 forward, 1.1 fwd+bwd; kern% 0.95; eff 0.97; comm 1 %; RSS 1.5; loaded drop 0.1."""
    good = dict(kernel_of_limit=0.96, efficiency=0.98, exposed_comm=0.005, rss_vs_model=1.2)
    rows = [_target_row("fwd", 0, vs_torch=1.16, **good),
            _target_row("fwd", 1, vs_torch=1.12, kernel_of_limit=0.94, efficiency=0.96, exposed_comm=0.015,
                        rss_vs_model=1.6),
            _target_row("fwd+bwd", 0, vs_torch=1.12, **good),
            _target_row("fwd+bwd", 1, vs_torch=1.05, **good),
            _target_row("fwd", 0, vs_torch=0.5, **dict(good, S=8192)),  # not a target row
            dict(_target_row("fwd", 0, vs_torch=0.5, **good), P=1)]
    text = format_targets(rows, {64: {"peak_flops": 100e9}})
    assert text.startswith("targets at S=16384, D=64, H=8, P=2, fp32:")
    assert "MISSED" not in _target_line(text, "fwd", "full")
    assert "x torch 1.160 (>=1.15 met)" in _target_line(text, "fwd", "full")
    assert "exposed comm 0.50% (<=1% met)" in _target_line(text, "fwd", "full")
    line = _target_line(text, "fwd", "causal")
    for missed in ("x torch 1.120 (>=1.15 MISSED)", "kernel of limit 0.940 (>=0.95 MISSED)",
                   "efficiency 0.960 (>=0.97 MISSED)", "exposed comm 1.50% (<=1% MISSED)",
                   "RSS/model 1.60 (<=1.5 MISSED)"):
        assert missed in line
    assert "x torch 1.120 (>=1.1 met)" in _target_line(text, "fwd+bwd", "full")
    assert "x torch 1.050 (>=1.1 MISSED)" in _target_line(text, "fwd+bwd", "causal")
    assert text.count("ceiling: 2 cores of square GEMM") == 4 and "loaded" not in text
    assert "CORETYPE" not in text and ">=1.5 " not in text and ">=1 " not in text  # the old goals are gone


def test_targets_give_the_bound_at_the_limit():
    """torch's time over the limit's: x torch of a ring whose kernels ran at the matmul+exp limit."""
    rows = [_target_row("fwd", 0, vs_torch=0.95, of_limit=0.8),    # torch 2.1 s, wall 2.0 s, limit 1.6 s
            _target_row("fwd", 1, vs_torch=0.9)]                   # no limit measured: no bound
    text = format_targets(rows, {64: {"peak_flops": 100e9}})
    lines = text.splitlines()
    full = lines.index(_target_line(text, "fwd", "full"))
    assert lines[full + 1].strip() == ("(at the matmul+exp limit = 1.19x torch; "
                                       "ceiling: 2 cores of square GEMM = 1.33x torch)")
    causal = lines.index(_target_line(text, "fwd", "causal"))
    assert lines[causal + 1].strip() == "(ceiling: 2 cores of square GEMM = 1.33x torch)"
    assert "limit =" not in format_targets(rows[1:])


def test_targets_under_load():
    good = dict(kernel_of_limit=0.96, efficiency=0.98, exposed_comm=0.005, rss_vs_model=1.2, load=1,
                wall_loaded_s=2.5)
    rows = [_target_row("fwd", 0, vs_torch=1.20, vs_torch_loaded=1.15, load_drop=0.05, **good),
            _target_row("fwd", 1, vs_torch=1.20, vs_torch_loaded=1.00, load_drop=0.20, **good),
            _target_row("fwd+bwd", 0, **good)]  # --no-torch: no ratio to compare
    text = format_targets(rows)
    assert "loaded: x torch 1.15 under load 1 (idle 1.20, drop 0.050 <= 0.1 met)" in text
    assert "loaded: x torch 1.00 under load 1 (idle 1.20, drop 0.200 <= 0.1 MISSED)" in text
    assert "loaded: wall 2.500 s under load 1 (idle 2.000 s), no torch column" in text
    loaded = format_table(rows, loaded=True).splitlines()
    assert loaded[0].split()[-5:] == ["wall@L", "torch@L", "x", "torch@L", "drop"]
    assert loaded[1].split()[-4:] == ["2.500", "-", "1.15", "0.05"]
    assert "wall@L" not in format_table(rows)


@pytest.mark.skipif(not torch_available(), reason="torch not installed")
def test_torch_column():
    (t,) = torch_times([Config(256, 16, H=2, causal=True)], threads=1, repeats=1, budget=5)
    assert t is not None and t > 0


def test_memory_model_parts():
    one = memory_model(Config(4096, 64), 1)
    two = memory_model(Config(4096, 64), 2)
    e = 4
    assert one["local_qkv"] == 3 * 4096 * 8 * 64 * e and one["kv_buffers"] == 0
    assert two["local_qkv"] == one["local_qkv"] // 2 and two["kv_buffers"] == 4 * 2048 * 8 * 64 * e
    assert one["total"] == sum(v for k, v in one.items() if k != "total")
    assert two["running_out"] == 2048 * 8 * 64 * 8  # float64, kept between calls
    assert "running_out" not in memory_model(Config(4096, 64, dtype="float64"), 2)  # the result itself
    back = memory_model(Config(4096, 64, backward=True), 2)
    assert back["total"] > two["total"]
    assert back["grad_accumulators"] == 0  # float32 sums are the gradients returned (Precision.sums)
    assert back["block_grads"] == 3 * 2048 * 8 * 64 * e  # a block's dq, dk, dv as the kernel gave them
    assert memory_model(Config(4096, 64, dtype="float16", backward=True), 2)["grad_accumulators"] == (
        2 * (2048 * 8 * 64 * 2) * 3)  # float32 sums of dq, dk, dv beside the float16 results
    assert memory_model(Config(8192, 64), 2)["total"] == 2 * two["total"]  # O(S/P)
    int8 = memory_model(Config(4096, 64, wire="int8"), 2)  # K/V slots as they travel: 1 byte + a 4-byte scale a row
    assert int8["kv_buffers"] == 4 * 2048 * 8 * (64 + 4) and int8["local_qkv"] == two["local_qkv"]
    if importlib.util.find_spec("ml_dtypes"):
        bf16 = memory_model(Config(4096, 64, dtype="bfloat16"), 2)
        assert bf16["kv_buffers"] == two["kv_buffers"] // 2 and bf16["lse"] == two["lse"]  # lse stays float32


def test_long_summary_takes_nothing_off_beyond_the_model():
    """The model counts the float64 running (out, lse) (``running_out``, ``lse``): the --long summary's
    "beyond model" is RSS - baseline - model, with nothing of it subtracted a second time."""
    from mpiring.tools.bench.sheet import format_long

    rows = [{"status": "ok", "S": S, "P": 2, "rss_per_rank_mb": "300 300", "model_mb": m, "baseline_mb": 240.0,
             "scratch_mb": x} for S, m, x in ((4096, 20.0, 12.0), (32768, 160.0, 25.0))]
    text = format_long(rows)
    assert text.splitlines()[2].split()[-1] == "12" and text.splitlines()[3].split()[-1] == "25"
    assert text.endswith("beyond the model 12 -> 25 MiB")


def test_guard_skips_what_does_not_fit():
    from mpi4py import MPI

    row = table.run_config(MPI.COMM_SELF, Config(1 << 20, 64), guard_mb=1024)
    assert row["status"].startswith("skipped: needs")


def test_table_and_csv_round_trip(tmp_path):
    rows = [{"P": 2, "S": 4096, "D": 64, "H": 8, "B": 1, "causal": 1, "layout": "zigzag", "pass": "fwd",
             "status": "ok", "wall_s": 0.5, "gflops": 10.0, "bytes_sent": 100, "bytes_predicted": 100,
             "bytes_match": 1, "peak_rss_mb": 80.0, "model_mb": 10.0, "baseline_mb": 60.0},
            {"P": 2, "S": 4096, "D": 64, "H": 8, "B": 1, "causal": 1, "layout": "zigzag", "pass": "fwd+bwd",
             "status": "skipped: reason", "model_mb": 10.0}]
    write_csv(rows, tmp_path / "r.csv")
    back = read_csv(tmp_path / "r.csv")
    assert back[0]["wall_s"] == 0.5 and back[0]["bytes_sent"] == 100 and back[1]["status"] == "skipped: reason"
    text = format_table(back)
    assert "causal" in text and "skipped: reason" in text and "yes" in text


def test_blas_report_warns_about_forced_kernels():
    code = "import json; from mpiring.tools.bench.probes import blas_report; print(json.dumps(blas_report()))"
    env = dict(os.environ, OPENBLAS_CORETYPE="Haswell")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    if not report["blas"].startswith("openblas"):
        pytest.skip("BLAS is not OpenBLAS")
    assert report["coretype_env"] == "Haswell" and report["blas_arch"].lower() == "haswell"
    assert (report["warning"] is not None) == (report["free_arch"].lower() != "haswell")


def test_long_mode_reports_memory_per_rank(tmp_path, capsys):
    from mpi4py import MPI

    path = tmp_path / "long.csv"
    assert bench.bench(MPI.COMM_SELF, ["--long", "--sizes", "256", "512", "--repeats", "1", "--csv", str(path)]) == 0
    text = capsys.readouterr().out
    assert "memory per rank" in text and "model x2.0" in text
    rows = read_csv(path)
    assert [(r["S"], r["H"], r["D"], r["causal"], r["pass"]) for r in rows] == [(256, 1, 64, 1, "fwd"),
                                                                              (512, 1, 64, 1, "fwd")]
    assert all(r["status"] == "ok" and r["peak_rss_mb"] > 0 for r in rows)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("args, expect", [
    (["--inference", "only", "--quick"], r"^decode: cache 4096 tokens, P=2, .* max error \S+ ok$"),
    (["serving", "--caches", "1024"], r"^\| 1024 \| 2 \| .* \| \S+ ok \|$"),
    (["overhead", "--sizes", "64", "--repeats", "1"], r"^64\s+Ring\s+[\d.]+"),
    (["overlap", "--seq-len", "256", "--repeats", "1", "--heads", "2"], r"^transfer alone .*: [\d.]+ s$"),
    (["peak"], r"(GFLOP/s float32 FMA peak, one core|no C compiler)"),  # no MPI: one process
])
def test_subcommands(args, expect):
    """The subcommands behind docs/inference.md, cluster.md and performance.md run on two ranks, rank 0 reports."""
    import re

    cmd = [sys.executable, "-m", "mpiring", "bench", *args]
    cmd = cmd if args == ["peak"] else mpiexec_argv(2, *cmd)
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert len(re.findall(expect, result.stdout, re.M)) == 1, result.stdout  # found, and printed once
    assert "FAILED" not in result.stdout
