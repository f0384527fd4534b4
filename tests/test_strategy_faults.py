"""Every strategy, one rank failing: every rank ends every case in bounded time, at P = 4 and 16 (oversubscribed).

    python -m pytest -q tests/test_strategy_faults.py

Each test is one ``mpiexec`` job of ``tests/strategy_fault_job.py`` running
several cases in turn (one failing rank: mid-forward, mid-backward, or where
the grid and the double ring make their communicators with MPI's blocking
``Split``); a case that leaves a rank waiting hangs the job, which the
job's hard limit ends, and the test fails. Before issue 34 the double ring's
waits and the grid's ``Split`` had no deadline: those jobs hung.
"""

import json
import os
import sys

import pytest

from launch import MPIEXEC, mpiexec_argv, run_limited

JOB = os.path.join(os.path.dirname(__file__), "strategy_fault_job.py")

pytestmark = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")

# P = 16: one case per strategy or more (the double ring's both passes, both Splits); P = 4: every case
SIXTEEN = ["ring:forward", "bidirectional:backward", "allgather:backward", "pass-q:backward", "ulysses:forward",
           "double_ring:forward", "double_ring:backward", "grid:forward", "grid:split", "double_ring_mpi_nodes:split"]


def _cases(n, timeout, failing, cases=(), drain=()):
    """Run the job; its JSON lines, one per case. A job over its hard limit is killed and fails the test."""
    cmd = mpiexec_argv(n, sys.executable, JOB, "--timeout", timeout, "--rank", failing, *(["--cases", *cases] if
                                                                                          cases else []),
                       *(["--drain", drain] if drain else []))
    code, out, err = run_limited(cmd, 60 + 12 * n * timeout)
    assert code == 0, f"{' '.join(cmd)}\n{out}\n{err[-3000:]}"
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _check(results, cases, P, timeout, failing):
    assert [r["case"] for r in results] == list(cases)
    # a rank gives up at its first wait past the timeout, or in the end-of-ring check (1.5 T + 0.5 s)
    bound = 1.5 * timeout + 0.5 + 3
    for r in results:
        outcomes, seconds = r["outcomes"], r["seconds"]
        assert len(outcomes) == P
        assert outcomes[failing] == f"RuntimeError: injected fault on rank {failing}", r
        assert all(o.startswith("CommTimeout: ") for i, o in enumerate(outcomes) if i != failing), r
        assert max(seconds) < bound, r


def test_every_strategy_at_4_ranks_ends_every_rank_in_time():
    """The ranks told of the failure drain their transfers for 0.25 s instead of the library's 1 s (18 cases: most
    of the job's time); the 16-rank job, and tests/test_faults.py's, keep the default."""
    from strategy_fault_job import CASES

    _check(_cases(4, 1.5, 1, drain=0.25), CASES, 4, 1.5, 1)


@pytest.mark.full  # the P = 4 job runs every case; this one a case per strategy at scale (oversubscribed)
def test_every_strategy_at_16_ranks_ends_every_rank_in_time():
    _check(_cases(16, 3, 5, SIXTEEN), SIXTEEN, 16, 3, 5)
