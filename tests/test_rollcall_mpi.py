"""A Ring call's agreement (``agree.check_call``) sends its all-reduce alone while every rank is there; only a
wait that lasts calls the roll (``mpi.rollcall``), at most one notice to each other rank, to name who is missing.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_rollcall_mpi.py
"""

import logging
import time

import pytest

from mpiring.mpi import waits
from mpiring.mpi.agree import check_call
from mpiring.plans.checks import Shown
from mpiring.tools.bench.callcost import CountedComm


@pytest.fixture
def counting(comm):
    private = comm.Dup()  # as a handle's private communicator
    yield CountedComm(private)
    private.Free()


@pytest.mark.mpi
def test_a_call_with_every_rank_there_sends_nothing_but_its_all_reduce(comm, counting):
    for call in range(5):
        highest = check_call(counting, None, {"n": Shown(call)}, [comm.rank + 1.0, 2.0], "auto")
        assert list(highest) == [comm.size, 2.0]
    assert counting.requests == 0  # were 2 (P - 1) per call: a notice to and from each other rank


@pytest.mark.mpi(min_size=2)
@pytest.mark.ranks(2, 4)
def test_a_late_rank_is_named_after_one_notice_to_each_other_rank(comm, counting, monkeypatch, caplog):
    monkeypatch.setattr(waits, "ENTRY_REPORT_SECONDS", 0.4)
    for late in (comm.size - 1, 0):  # the second: notices of the first call are not counted for it
        counting.requests = 0
        caplog.clear()
        if comm.rank == late:
            time.sleep(1.5)
        with caplog.at_level(logging.WARNING, logger="mpiring"):
            check_call(counting, None, {}, [1.0, 1.0], "auto")
        assert counting.requests <= comm.size - 1  # one notice to each other rank at most
        if comm.rank != late:
            logged = [r.getMessage() for r in caplog.records]
            assert logged and all(f"rank {late} has not entered the call" in m for m in logged), logged
    counting.requests = 0
    check_call(counting, None, {}, [1.0, 1.0], "auto")
    assert counting.requests == 0
    comm.Barrier()


@pytest.mark.mpi
@pytest.mark.ranks(1, 2)
def test_bench_callcost_times_the_call_its_agreement_and_an_iallreduce(comm, capsys):
    from mpiring.tools.bench.callcost import callcost

    assert callcost(comm, ["--repeats", "3"]) == 0
    if comm.rank == 0:
        lines = capsys.readouterr().out.splitlines()
        assert lines[1] == "| P | Ring.forward | its agreement | Iallreduce | its point-to-point requests |"
        assert lines[3].startswith(f"| {comm.size} | ") and all(float(c) > 0 for c in lines[3].split("|")[2:5])
        assert lines[3].endswith(" | 0 |")  # the agreement posts its all-reduce alone
