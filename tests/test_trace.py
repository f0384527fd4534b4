"""Events, the Chrome trace, the timeline plot and the progress line.

    python -m pytest --with-mpi -q tests/test_trace.py
    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_trace.py
"""

import io
import json
import subprocess
import sys

import numpy as np
import pytest

from mpiring.tools.plot import plot_timeline
from mpiring.tools.progress import Progress, stdout_is_terminal
from mpiring.tools.trace import chrome_trace, format_timeline, measured_steps, step_table, write_chrome_trace

from launch import MPIEXEC, clean_env, mpiexec_argv

SKEW = 0.05  # seconds: start-barrier exit skew allowed between ranks (generous: ranks may share cores)


def _fake_records():
    """Two ranks, two steps, hand-made times (seconds after t0 = 10)."""
    def rec(rank, events):
        return {"rank": rank, "t0": 10.0, "events": [(n, 10.0 + a, 10.0 + b, info) for n, a, b, info in events]}
    return [
        rec(0, [("send", 0.0, 0.001, {"step": 0, "stream": 1, "dest": 1, "bytes": 64}),
                ("compute", 0.001, 0.011, {"step": 0, "source": 0, "kind": "masked", "stream": 1}),
                ("wait", 0.011, 0.020, {"step": 0}),
                ("wait", 0.020, 0.021, {"step": 1})]),
        rec(1, [("send", 0.0, 0.001, {"step": 0, "stream": 1, "dest": 0, "bytes": 64}),
                ("compute", 0.001, 0.019, {"step": 0, "source": 1, "kind": "masked", "stream": 1}),
                ("wait", 0.019, 0.020, {"step": 0}),
                ("compute", 0.020, 0.040, {"step": 1, "source": 0, "kind": "full", "stream": 1}),
                ("wait", 0.040, 0.040, {"step": 1})]),
    ]


def test_step_table_by_hand():
    rows = step_table(_fake_records())
    r0, r1 = rows
    assert [s["end"] for s in r0] == pytest.approx([0.020, 0.021])
    assert r0[0]["compute"] == pytest.approx(0.010) and r0[0]["wait"] == pytest.approx(0.009)
    assert r0[0]["idle"] == pytest.approx(0.001)  # posting the send
    assert r1[1]["compute"] == pytest.approx(0.020) and r1[1]["wait"] == 0
    assert measured_steps(_fake_records())[1] == pytest.approx((0.020, 0.020, 0.001))


def test_chrome_trace_structure():
    trace = json.loads(json.dumps(chrome_trace(_fake_records(), title="t")))
    ev = trace["traceEvents"]
    names = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    compute = [e for e in ev if e.get("cat") == "compute"]
    assert {e["tid"] for e in compute} == {0}
    assert {e["tid"] for e in ev if e.get("cat") == "comm"} == {1}
    assert [e["ts"] for e in compute if e["pid"] == 1] == [1000.0, 20000.0]  # microseconds since t0
    assert compute[0]["dur"] == pytest.approx(10000.0)
    flows = [e for e in ev if e["ph"] in "sf"]
    assert len(flows) == 4 and {e["id"] for e in flows} == {1, 2}
    steps = [e for e in ev if e.get("cat") == "step"]
    assert len(steps) == 4


def test_backward_flows_end_at_the_wait_for_their_data():
    """K/V at the same step's K/V wait, a dK/dV partial at the next step's, a chunk home at the final wait."""
    def rec(rank, events):
        return {"rank": rank, "t0": 0.0, "events": [(n, a, b, info) for n, a, b, info in events]}
    other = 1
    records = [rec(0, [("send", 0.0, 0.0, {"step": 0, "dest": other, "data": "K/V"}),
                       ("send", 0.5, 0.5, {"step": 1, "dest": other, "data": "dK/dV"}),
                       ("send", 0.6, 0.6, {"step": 2, "dest": other, "data": "dK/dV home"})]),
               rec(other, [("wait", 0.1, 0.2, {"step": 0, "data": "dK/dV"}),
                           ("wait", 0.2, 0.3, {"step": 0, "data": "K/V"}),
                           ("wait", 0.7, 0.8, {"step": 2, "data": "dK/dV"}),
                           ("wait", 0.9, 1.0, {"step": 3, "data": "dK/dV home"})])]
    ev = chrome_trace(records)["traceEvents"]
    ends = {e["name"]: e["ts"] for e in ev if e["ph"] == "f"}
    assert ends == {"K/V": 200000.0, "dK/dV": 700000.0, "dK/dV home": 900000.0}


def test_text_timeline():
    text = format_timeline(_fake_records(), width=40)
    lines = text.splitlines()
    assert lines[0].startswith("rank  0") and lines[1].startswith("rank  1")
    assert "#" in lines[0] and "w" in lines[0] and "compute" in lines[0]


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    path = plot_timeline(_fake_records(), str(tmp_path / "t.png"), title="fake", note="a note")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ImportError, match=r'pip install -e "\.\[plot\]" in the mpiring checkout'):
        plot_timeline(_fake_records(), str(tmp_path / "t.png"))


def test_progress_line():
    out = io.StringIO()
    p = Progress("step", enabled=True, stream=out, interval=0)
    for s in range(1, 4):
        p(s, 3)
    p.close()
    text = out.getvalue()
    assert "\rstep 1/3" in text and "\rstep 3/3" in text and text.endswith("\r\033[K")
    quiet = io.StringIO()
    q = Progress(stream=quiet)  # auto: a StringIO is not a terminal
    q(1, 2)
    q.close()
    assert quiet.getvalue() == "" and not stdout_is_terminal(quiet)


# ---------------------------------------------------------------- real runs under MPI


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,mode", [("contiguous", "ring"), ("zigzag", "ring"), ("striped", "bidirectional"),
                                         ("zigzag", "allgather")])
def test_trace_of_a_real_run(tmp_path_factory, layout, mode):
    from mpi4py import MPI

    from mpiring import distributed_attention

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    rng = np.random.default_rng(5)
    Q, K, V = (rng.standard_normal((2, 24 * size, 8)) for _ in range(3))
    out, sched = distributed_attention(Q, K, V, comm, causal=True, layout=layout, mode=mode)
    if rank != 0:
        return
    plan = sched.plan
    path = tmp_path_factory.mktemp("trace") / "trace.json"
    write_chrome_trace(str(path), sched.records)
    with open(path) as f:
        ev = json.load(f)["traceEvents"]
    assert {e["pid"] for e in ev} == set(range(size))
    for r in range(size):
        mine = [e for e in ev if e["pid"] == r and e["ph"] == "X"]
        computed = sorted((e["args"]["step"], e["args"]["source"]) for e in mine if e["cat"] == "compute")
        planned = sorted((s, t.source) for s in range(plan.n_steps) for t in plan.tasks(s, r) if t.kind != "skip")
        assert computed == planned
        assert sorted(e["name"] for e in mine if e["cat"] == "step") == sorted(f"step {s}" for s in range(plan.n_steps))
        for tid in (0, 1, 2):  # on each row, events follow each other without overlap
            row = sorted((e["ts"], e["ts"] + e["dur"]) for e in mine if e["tid"] == tid)
            assert all(a[1] <= b[0] + 1e-3 for a, b in zip(row, row[1:]))
            assert all(0 <= a <= b for a, b in row)
        if mode != "allgather":
            assert len([e for e in mine if e["cat"] == "comm" and e["name"] == "wait"]) == plan.n_steps
            sends = [e for e in mine if e["name"].startswith("send")]
            assert len(sends) == sum(plan.rounds.values())
            assert all(e["args"]["bytes"] > 0 for e in sends)
    # causality on the common clock: a block arrives after its sender posted it
    starts = {(e["pid"], e["args"]["step"], e["args"]["dest"]): e["ts"] for e in ev if e["name"].startswith("send")}
    waits = {(e["pid"], e["args"]["step"]): e["ts"] + e["dur"] for e in ev if e["name"] == "wait"}
    for (_, step, dest), ts in starts.items():
        if (dest, step) in waits:
            assert ts <= waits[dest, step] + SKEW * 1e6


@pytest.mark.mpi(min_size=2)
def test_progress_callback_sees_every_step():
    from mpi4py import MPI

    from mpiring import distributed_attention

    comm = MPI.COMM_WORLD
    seen = []
    Q = np.ones((4 * comm.Get_size(), 4))
    distributed_attention(Q, Q, Q, comm, on_step=lambda done, total: seen.append((done, total)))
    n = comm.Get_size()
    assert seen == [(s, n) for s in range(1, n + 1)]


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_run_writes_trace_and_plot(tmp_path):
    args = ["--seq-len", "96", "--heads", "2", "--dim", "8", "--causal", "--layout", "zigzag",
            "--trace", "t.json", "--progress", "on"]
    plot = pytest.importorskip("matplotlib", reason="no matplotlib") and ["--plot", "t.png"]
    result = subprocess.run(mpiexec_argv(2, sys.executable, "-m", "mpiring", "run", *args, *plot),
                            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "predicted" in result.stdout and "measured" in result.stdout
    assert "timeline (text" in result.stdout and "rank  1 " in result.stdout
    assert result.stdout.count("ring step (rank 0) 2/2") == 1  # forced on; rank 0 only
    with open(tmp_path / "t.json") as f:
        assert {e["pid"] for e in json.load(f)["traceEvents"]} == {0, 1}
    assert (tmp_path / "t.png").stat().st_size > 1000
