"""What one rank did in a ring: the tasks it ran, timed events and traffic counters. No MPI."""

import time
from dataclasses import dataclass, field

__all__ = ["Record"]

# the counters a rank sends to root (``distributed_*``): everything but the tasks, plan and callback
SUMMARY = ("rank", "bytes_sent", "messages", "wait_time", "compute_time", "wall_time", "events", "t0",
           "computed_pairs", "visible_pairs", "wire_dtype", "error")


@dataclass(eq=False)
class Record:
    """What one rank did: the tasks it ran, timed events, and traffic counters.

    ``events`` holds ``(name, start, end, info)`` with time.perf_counter()
    stamps; name is "compute" (info: step, source, kind, stream), "send"
    (posted: step, stream, bytes, dest) or "wait" (step). Subtract ``t0``, this
    rank's clock right after a start barrier, to put every rank on one time
    base (good to the barrier's exit skew, microseconds). ``wire_dtype`` is how
    K/V travelled; ``error`` is filled in by whoever checks the results against
    float64 (``python -m mpiring run``: the largest error of out, lse, dQ, ...).
    """

    rank: int = 0
    tasks: list = field(default_factory=list)  # (step, Task) in the order they were processed
    events: list = field(default_factory=list)
    t0: float = 0.0
    on_step: object = None  # optional callback(steps_done, n_steps), called after each step
    bytes_sent: int = 0
    messages: int = 0
    wait_time: float = 0.0
    compute_time: float = 0.0
    computed_pairs: int = 0  # score entries given to the kernel
    visible_pairs: int = 0  # of those, the ones the mask lets through
    wall_time: float = 0.0
    wire_dtype: str = ""  # how K/V travelled: the input dtype's name, or a ``wire_dtype`` ("int8", "float8_e4m3", ...)
    error: dict = field(default_factory=dict)  # max |result - float64 reference| by name, if a checker filled it in
    plan: object = None  # the Plan the ring followed, set when the call returns
    rotate: str = "kv"  # what travelled the ring: "kv" (K/V blocks) or "q" (query blocks; ``rotate="auto"`` decides)

    def event(self, name, start, **info):
        """Record an event that started at ``start`` and ends now; returns now."""
        end = time.perf_counter()
        self.events.append((name, start, end, info))
        return end

    def step_done(self, step, n_steps):
        """Call ``on_step`` (if set) after a step."""
        if self.on_step is not None:
            self.on_step(step + 1, n_steps)

    def table(self, n_steps):
        """This rank's column of the schedule: the tasks of each step."""
        column = [[] for _ in range(n_steps)]
        for step, task in self.tasks:
            column[step].append(task)
        return [tuple(c) for c in column]

    def summary(self):
        """The counters and events as a plain dict (what ranks send to root)."""
        return {key: getattr(self, key) for key in SUMMARY}
