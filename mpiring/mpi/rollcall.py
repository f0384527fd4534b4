"""Who has entered a ``Ring`` call, found out only when its entry's wait lasts.

A ``Ring`` call opens with one non-blocking all-reduce on the handle's private
communicator (``agree.check_call``): O(log P) messages per rank, and every
rank has arrived once it completes. Nothing else is sent while the wait is
short. Once it has lasted half way to its first warning or its timeout
(``waits.wait_entry``), this rank calls the roll: a notice of two int64 (the
call's number, "answer me") to every rank it has not told yet. Every rank
waiting in the same call answers a notice with its own, once per peer; a rank
that enters later answers the notices waiting for it. At the warning or the
timeout, the ranks this one has not heard from are those that have not
entered. The call's number is counted per communicator (alike on every rank,
as every call is collective), so a notice of another call is never counted.
"""

import numpy as np
from mpi4py import MPI

from .waits import completed

__all__ = ["RollCall", "ROLL_TAG"]

ROLL_TAG = 32001  # on the handle's private communicator: the ring's chunks use tags 4 * chunk + 0..3, failures 32000
_KEY = MPI.Comm.Create_keyval()


def _state(comm):
    """What ``comm``'s roll calls keep between calls (an attribute of the communicator, freed with it)."""
    state = comm.Get_attr(_KEY)
    if state is None:
        state = {"call": 0, "heard": {}, "asked": {}, "sends": []}
        comm.Set_attr(_KEY, state)
    return state


class RollCall:
    """This rank's side of one call's roll call on ``comm``: ``poll()`` takes the notices that have come (and
    answers them), ``ask()`` calls the roll, ``absent()`` is who has not been heard from."""

    def __init__(self, comm):
        self.comm, self.rank = comm, comm.Get_rank()
        self._state = state = _state(comm)
        state["call"] += 1
        self.call = state["call"]
        state["sends"] = [s for s in state["sends"] if not completed([s[0]])]  # notices long delivered: let go
        self.heard = state["heard"].pop(self.call, set())  # notices of this call that came during the last one
        for old in [c for c in state["heard"] if c < self.call]:
            del state["heard"][old]
        self.told = set()
        self._buffer = np.zeros(2, np.int64)
        for source in state["asked"].pop(self.call, ()):
            self._tell(source, asks=False)
        state["asked"] = {c: s for c, s in state["asked"].items() if c > self.call}
        self.poll()

    def _tell(self, dest, asks):
        notice = np.array([self.call, int(asks)], np.int64)
        self._state["sends"].append((self.comm.Isend(notice, dest=dest, tag=ROLL_TAG), notice))
        self.told.add(dest)

    def poll(self):
        """Take every notice that has come: its sender has entered its call; answer one that asks, once per peer."""
        status = MPI.Status()
        while (message := self.comm.Improbe(MPI.ANY_SOURCE, ROLL_TAG, status)) is not None:
            message.Recv(self._buffer)
            call, asks, source = int(self._buffer[0]), bool(self._buffer[1]), status.Get_source()
            if call == self.call:
                self.heard.add(source)
                if asks and source not in self.told:
                    self._tell(source, asks=False)
            elif call > self.call:  # a rank already in the next call (this one's all-reduce done, not yet seen)
                self._state["heard"].setdefault(call, set()).add(source)
                if asks:
                    self._state["asked"].setdefault(call, set()).add(source)

    def ask(self):
        """Call the roll: a notice that asks for an answer to every rank not yet told."""
        for dest in range(self.comm.Get_size()):
            if dest != self.rank and dest not in self.told:
                self._tell(dest, asks=True)

    def absent(self):
        """The ranks not heard from in this call (after ``ask``: those that have not entered it)."""
        self.poll()
        return [r for r in range(self.comm.Get_size()) if r != self.rank and r not in self.heard]
