"""The command line: schedule (no MPI) and run (under mpiexec, as a user types it)."""

import os
import subprocess
import sys

import pytest

from mpiring.__main__ import MOVED, main, parse

from launch import MPIEXEC, clean_env, mpiexec_argv


def test_schedule_command(capsys):
    assert main(["schedule", "-P", "4", "--layout", "zigzag", "--causal"]) == 0
    text = capsys.readouterr().out
    assert "rank 3" in text and "max/mean visible pairs: 1.000" in text


def test_schedule_balance_prints_every_balancer(capsys):
    assert main(["schedule", "-P", "3", "--frames", "6", "--frame-tokens", "16", "--balance", "greedy"]) == 0
    text = capsys.readouterr().out
    assert "balance=greedy causal_block=16" in text and "greedy*" in text
    last = text.splitlines()[-1].split()
    assert last[0] == "max/mean" and float(last[1]) > 1.3 and float(last[-1]) < 1.05  # contiguous .. greedy
    assert main(["schedule", "-P", "2", "--causal-block", "4"]) == 2
    assert "causal_block=4 needs causal=True" in capsys.readouterr().err


def test_cost_command(capsys):
    assert main(["cost", "--seq-len", "1024", "-P", "4", "--hidden", "64", "--heads", "8"]) == 0
    assert "total_comm_bytes: 196608" in capsys.readouterr().out


def test_bad_arguments_exit_nonzero(capsys):
    assert main(["cost", "--seq-len", "1000", "-P", "3", "--hidden", "64", "--heads", "8", "--dim", "7"]) == 2
    assert "--hidden 64 must be K/V heads x --dim 7" in capsys.readouterr().err


def test_cost_report_floors_uneven_lengths_as_its_contract(capsys):
    assert main(["cost", "--seq-len", "1000", "-P", "3", "--hidden", "64", "--heads", "8"]) == 0
    assert "chunk_length: 333" in capsys.readouterr().out


def test_bench_subcommands_and_the_commands_that_moved_under_it(capsys):
    """``bench`` runs the table or a named subcommand; an old top-level spelling still runs it, with a note."""
    assert parse(["bench", "--quick"])[1].quick and parse(["bench", "plan", "-P", "8"])[1].ranks == [8]
    for old, new in MOVED.items():
        assert vars(parse([old])[1]) == vars(parse(["bench", new])[1])
    assert main(["planbench", "-P", "4", "--tokens-per-rank", "4", "--repeats", "1"]) == 0
    captured = capsys.readouterr()
    assert "python -m mpiring planbench is deprecated: use python -m mpiring bench plan" in captured.err
    assert "| 4 | 16 |" in captured.out
    assert main(["bench", "plan", "-P", "0x"]) == 2 and "invalid int value" in capsys.readouterr().err


def _mpirun(n, *args, timeout=120):
    cmd = mpiexec_argv(n, sys.executable, "-m", "mpiring", "run", *args)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=clean_env())


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("args", [
    ["--seq-len", "256", "--heads", "2", "--dim", "16", "--causal", "--layout", "zigzag"],
    ["--seq-len", "250", "--heads", "4", "--kv-heads", "2", "--dim", "8", "--dtype", "float64",
     "--mode", "bidirectional", "--window", "40", "0", "--causal"],
    ["--frames", "7", "--frame-tokens", "30", "--causal-block", "--balance", "greedy", "--heads", "2", "--dim", "8",
     "--dtype", "float64", "--backward", "--mode", "allgather"],
    ["--seq-len", "200", "--cu-seqlens", "0", "150", "170", "200", "--causal", "--balance", "headtail",
     "--window", "50", "0", "--heads", "2", "--dim", "8", "--dtype", "float64", "--backward"],
    ["--seq-len", "240", "--heads", "4", "--dim", "8", "--dtype", "float64", "--backward", "--layout", "zigzag",
     "--mask", "causal|prefix:30", "--softcap", "2", "--sinks", "0.5", "1", "1.5", "2", "--dropout", "0.1"],
])
def test_run_verifies(args):
    result = _mpirun(3, *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VERIFIED" in result.stdout and "recorded schedule equals the plan: yes" in result.stdout
    assert result.stdout.count("VERIFIED") == 1  # only rank 0 reports


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("args", [
    ["--dtype", "float32"],  # docs/cluster.md's example: it exited 1 (float64 gradients modelled, float32 sent)
    ["--dtype", "float64"],
    ["--dtype", "float32", "--grad-wire-dtype", "float64", "--accumulate", "float32", "--layout", "zigzag"],
])
def test_grid_backward_verifies_with_its_options(args):
    """ring x Ulysses with --backward: results and the bytes the model predicts, with the options honoured."""
    result = _mpirun(4, "--seq-len", "256", "--heads", "4", "--dim", "16", "--causal", "--ulysses-size", "2",
                     "--backward", *args)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "VERIFIED" in result.stdout and "recorded schedule equals the plan: yes" in result.stdout
    if "--accumulate" in args:
        assert "running (out, lse): float32, float32; dK/dV partials on the wire: float64" in result.stdout


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_run_prints_the_same_schedule_as_the_schedule_command(capsys):
    options = ["--causal", "--layout", "striped", "--window", "100", "0", "--cu-seqlens", "0", "50", "300"]
    assert main(["schedule", "-P", "3", "--seq-len", "300", *options]) == 0
    planned = capsys.readouterr().out
    result = _mpirun(3, "--seq-len", "300", "--heads", "2", "--dim", "8", *options)
    assert result.returncode == 0, result.stdout + result.stderr

    def table(text):  # from the header line to the per-rank compute totals
        lines = text.splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("step  rank 0"))
        end = next(i for i, line in enumerate(lines) if line.startswith("max/mean visible pairs"))
        return lines[start:end + 1]

    assert table(result.stdout) == table(planned)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_run_bad_input_fails_on_every_rank_quickly():
    result = _mpirun(2, "--seq-len", "1", "--heads", "1", "--dim", "4", timeout=60)
    assert result.returncode != 0
    assert "shorter than the number of ranks" in result.stderr
    result = _mpirun(2, "--seq-len", "64", "--cu-seqlens", "0", "10", "60", "--causal", "--balance", "greedy",
                     timeout=60)
    assert result.returncode == 2 and "cu_seqlens must start at 0 and end at the total length 64" in result.stderr


def test_commands_leave_the_thread_counts_as_they_found_them():
    """run, generate and bench set --threads for their own work only: called as functions (as tests and
    notebooks do), they must not change later calls' BLAS thread count, which picks the GEMM library and so
    the last bits of every later result (found by tests/test_history_mpi.py after test_generate_mpi)."""
    from mpi4py import MPI
    from threadpoolctl import threadpool_info

    from mpiring.tools.bench import bench
    from mpiring.tools.cli_generate import generate
    from mpiring.tools.cli_run import run

    def counts():
        return sorted((i["internal_api"], i["filepath"], i["num_threads"]) for i in threadpool_info())

    before = counts()
    assert run(MPI.COMM_SELF, ["--seq-len", "32", "--heads", "2", "--dim", "8", "--threads", "1"]) == 0
    assert generate(MPI.COMM_SELF, ["--prompt-len", "16", "--new-tokens", "1", "--heads", "2", "--dim", "8",
                                    "--threads", "1"]) == 0
    assert bench(MPI.COMM_SELF, ["--quick", "--sizes", "256", "--dims", "16", "--heads", "2", "--repeats", "1",
                                 "--precisions", "fp32", "--no-torch", "--threads", "1", "--csv", os.devnull]) == 0
    assert counts() == before
