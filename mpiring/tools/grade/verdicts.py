"""Verdicts on one case, from what every rank saw (every rank computes the same ones).

- safety: every rank returned, without an exception, a stuck call or an unfinished request;
- output: every rank's output within the tolerance (with the hints of the worst rank);
- traffic: the bytes each rank sent against the exercise's cost model (decode: the rounds of its merge tree).
"""

import math
from dataclasses import dataclass, field

import numpy as np

from ...core.ranks import ranks_text
from ...testing.timed import size_text

__all__ = ["ALLOWANCE", "Verdict", "merge_rounds", "output_verdict", "ranks_text", "safety_verdict", "traffic_model",
           "traffic_verdict", "tree_verdict"]

ALLOWANCE = 512  # bytes a pickled message (send, isend, allgather, ...) may carry above its array data


@dataclass
class Verdict:
    status: str  # "ok" | "FAIL" | "not run"
    short: str = ""
    details: list = field(default_factory=list)
    hints: list = field(default_factory=list)


def safety_verdict(runs):
    stuck = {r: run.stuck for r, run in enumerate(runs) if run.outcome == "stuck"}
    raised = [r for r, run in enumerate(runs) if run.outcome == "raised"]
    if stuck:
        return _hang_verdict(runs, stuck)
    if raised:
        first = runs[raised[0]]
        same = [r for r in raised if runs[r].exception == first.exception]
        details = [f"{ranks_text(same)} raised {first.exception}", first.error]
        details += [f"rank {r} raised {runs[r].exception}" for r in raised if r not in same]
        hints = []
        if first.exception.startswith("NotImplementedError"):
            hints.append(("todo", "a TODO is left: fill it in"))
        return Verdict("FAIL", "raised", details, hints)
    left = [(r, run.left) for r, run in enumerate(runs) if run.left]
    if left:
        details = [f"rank {r} returned with {len(texts)} unfinished request(s): {', '.join(texts[:3])}"
                   for r, texts in left]
        return Verdict("FAIL", "unfinished requests", details,
                       [("requests", ("wait for every request before returning: until it completes, a send's buffer "
                                     "may not be reused and a receive's data may not be there"))])
    return Verdict("ok")


def _hang_verdict(runs, stuck):
    P = len(runs)
    every_send = len(stuck) == P and all(waiting and all(kind == "send" for kind, _, _ in waiting)
                                         for _, waiting, _ in stuck.values())
    if every_send:
        first = min(stuck)
        call, _, seconds = stuck[first]
        details = [(f"unsafe: rank {first} blocked in {call} for {seconds:.1f} s — every rank sends before it "
                   f"receives; use Isend/Irecv or Sendrecv")]
        details += [f"rank {r} blocked in {stuck[r][0]}" for r in sorted(stuck) if r != first]
        hints = [("unsafe", ("MPI may finish a small send before its receive is posted, by buffering it, but need "
                            "not; the grader runs every send in synchronous mode, so this ring deadlocks at every "
                            "size (on real MPI it deadlocks once messages pass the eager limit: "
                            "mpiexec -n 2 python -m mpiring demo deadlock shows it)"))]
        return Verdict("FAIL", "deadlock (unsafe)", details, hints)
    details = []
    for r, (call, waiting, seconds) in sorted(stuck.items()):
        line = f"rank {r} waited {seconds:.1f} s in {call}"
        texts = [text for _, _, text in waiting if text != call]
        if texts:
            line += " for: " + ", ".join(texts)
        peers = {}
        for kind, peer, _ in waiting:
            if isinstance(peer, int) and 0 <= peer < P and peer != r:
                peers.setdefault(peer, kind)
        for peer, kind in peers.items():
            other = runs[peer]
            if other.outcome == "returned":
                line += f"; rank {peer} had returned without {'receiving' if kind == 'send' else 'sending'} it"
            elif other.outcome == "raised":
                line += f"; rank {peer} had raised {other.exception}"
            else:
                line += f"; rank {peer} was itself blocked in {other.stuck[0]}"
        details.append(line)
    raised = [r for r, run in enumerate(runs) if run.outcome == "raised"]
    if raised:
        details += [f"rank {raised[0]} raised {runs[raised[0]].exception}", runs[raised[0]].error]
        hints = [("raised", "a rank raised an error and the others waited for it")]
    elif len(stuck) == P and all(all(kind == "recv" for kind, _, _ in w) for _, w, _ in stuck.values()):
        hints = [("recv-first", ("every rank waits to receive before any rank sends: start the send first (Isend), "
                                "or use Sendrecv"))]
    else:
        hints = [("mismatch", ("a rank waits for a message nobody sends it (or sends one nobody receives): check that "
                              "rank r sends to (r + 1) % P and receives from (r - 1) % P, with the same tags, the "
                              "same number of times"))]
    return Verdict("FAIL", "stuck", details, hints)


def output_verdict(checks):
    bad = [r for r, c in enumerate(checks) if not c["ok"]]
    worst = max((c["error"] for c in checks if c["error"] is not None), default=None)
    short = f"max error {worst:.2g}" if worst is not None else ""
    if not bad:
        return Verdict("ok", short)
    first = checks[bad[-1]]  # the last rank sees the most blocks: its hint says the most
    details = [f"wrong on {ranks_text(bad)}: {first['text']}"]
    hints = list(first["hints"])
    for r in bad[:-1]:  # other kinds of mistakes on other ranks
        for kind, text in checks[r]["hints"]:
            if kind not in {k for k, _ in hints}:
                hints.append((kind, text))
    return Verdict("FAIL", short or "wrong", details, hints[:3])


def traffic_model(case, exercise, P):
    """(bytes each rank may send, how the model counts them, the hint when a rank sends more)."""
    h, n, d = case.shape
    if exercise.traffic == "ulysses":
        model = (P - 1) * (2 * case.q_message + 2 * case.message) // P
        return model, (f"q, k, v and out each through an all-to-all, (P - 1)/P = {P - 1}/{P} of them leaving the "
                       f"rank: {model} bytes"), (
            "Ulysses moves q, k, v and the output once each with an all-to-all (comm.Alltoall): only (P - 1)/P of "
            "each leaves the rank; gathering K/V or passing them round a ring sends more")
    if exercise.traffic == "passq":
        partial = h * n * (d + 1) * 8
        model = (P - 1) * (case.q_message + partial)
        return model, (f"(P - 1) = {P - 1} query blocks of {case.q_message} bytes and {P - 1} partials (out, lse) "
                       f"in float64 of {partial} bytes going home"), (
            "pass-Q: the query blocks travel the ring and each partial (out, lse) goes home once; K/V never leave "
            "their rank")
    if exercise.traffic == "allreduce":
        chunk = -(-case.extra["N"] // P) * np.dtype(case.dtype).itemsize
        model = 2 * (P - 1) * chunk
        return model, f"2 (P - 1) = {2 * (P - 1)} chunks of at most ceil(N/P) elements ({chunk} bytes)", (
            "a ring all-reduce sends 2 (P - 1) chunks of N/P elements: P - 1 steps of reduce-scatter, then P - 1 of "
            "all-gather; sending the whole array round the ring costs P/2 times more")
    block = 2 * case.message
    model = (P - 1) * block
    text = (f"(P - 1) = {P - 1} K/V blocks per rank, i.e. 2 (P - 1) = {2 * (P - 1)} messages of "
            f"n*Hkv*D*itemsize = {case.message} bytes")
    hint = "you send K/V more than P - 1 times: each block needs P - 1 hops to visit every other rank"
    if exercise.group > 1:
        hint += (f"; the ring carries the {case.kv_heads} K/V heads: repeat them for the {h} query heads after "
                 f"receiving, not before sending")
    if exercise.kind == "backward":
        grads = P * 2 * h * n * d * 8
        model += grads
        text += f", plus dK/dV going home at most P = {P} times in float64 ({size_text(grads)})"
    return model, text, hint


def traffic_verdict(case, exercise, runs):
    P = len(runs)
    if any(run.outcome != "returned" for run in runs):
        return Verdict("not run")
    if exercise.traffic == "tree":
        return tree_verdict(runs)
    model, model_text, hint = traffic_model(case, exercise, P)
    sent = [run.bytes + run.collective_bytes for run in runs]
    worst = int(np.argmax(sent))
    short = f"{size_text(sent[worst])}/rank, model {size_text(model)}"
    details, hints = [], []
    if sent[worst] > model + ALLOWANCE * runs[worst].pickled:
        ratio = sent[worst] / model if model else math.inf
        details.append(f"rank {worst} sent {sent[worst]} bytes in {runs[worst].messages} messages, "
                       f"{ratio:.3g} x the cost model: {model_text} ({model} bytes)")
        hints.append(("traffic", hint))
    if P > 1 and not any(sent):
        details.append("no data went through comm")
        hints.append(("no-comm", "the data must travel through the communicator you are given (comm)"))
    world = [r for r, run in enumerate(runs) if run.world_calls]
    if world:
        details.append(f"{ranks_text(world)} called MPI.COMM_WORLD")
        hints.append(("world", "use the comm argument, not MPI.COMM_WORLD: the code must run on any communicator"))
    if exercise.traffic == "allreduce":
        used = sorted({name for run in runs for name in run.collectives})
        if used:
            details.append(f"collectives used: {', '.join(used)}")
            hints.append(("collective", "write the ring yourself with point-to-point messages (Isend/Irecv or "
                                        "Sendrecv): this warm-up is the algorithm inside Allreduce"))
    if exercise.directions and P >= 3:
        details, hints = _directions(case, runs, details, hints)
    return Verdict("FAIL" if details else "ok", short, details, hints)


def _directions(case, runs, details, hints):
    P = len(runs)
    for r, run in enumerate(runs):
        ahead, behind = run.sent_to.get((r + 1) % P, 0), run.sent_to.get((r - 1) % P, 0)
        limit = (P // 2) * 2 * case.message + ALLOWANCE * run.pickled
        if not ahead or not behind:
            details.append(f"rank {r} sent {size_text(ahead)} to rank {(r + 1) % P} and {size_text(behind)} "
                           f"to rank {(r - 1) % P}")
            hints.append(("directions", "a bidirectional ring sends K/V both ways"))
            break
        if max(ahead, behind) > limit:
            details.append(f"rank {r} sent {size_text(max(ahead, behind))} one way, more than floor(P/2) = "
                           f"{P // 2} K/V blocks")
            hints.append(("directions", ("going both ways, every block is at most floor(P/2) hops from each rank "
                                        "that needs it")))
            break
    return details, hints


GATHERS = ("gather", "Gather", "allgather", "Allgather", "Allgatherv")


def merge_rounds(runs):
    """Rounds of merging before rank 0 has every partial, from who sent to whom (a gather counts as P - 1).

    On the graph of point-to-point messages (each rank sends its merged partial once it has merged
    what it received): the longest chain of messages into a rank; with exchanges both ways (a
    butterfly) the most partners any rank received from.
    """
    P = len(runs)
    if any(name in GATHERS for run in runs for name in run.collectives):
        return P - 1
    sources = [{s for s, n in run.received_from.items() if n and s != r} for r, run in enumerate(runs)]
    depth, state = {}, {}

    def chain(r):
        if state.get(r) == "open":
            raise RecursionError
        if r not in depth:
            state[r] = "open"
            depth[r] = max((chain(s) + 1 for s in sources[r]), default=0)
            state[r] = "done"
        return depth[r]

    try:
        return max(chain(r) for r in range(P))
    except RecursionError:
        return max(len(s) for s in sources)


def tree_verdict(runs):
    """Decode: the partials merged in at most ceil(log2 P) rounds (a tree), not one after another."""
    from .exercises import tree_rounds

    P = len(runs)
    rounds, allowed = merge_rounds(runs), tree_rounds(P)
    short = f"{rounds} rounds of merging, a tree needs {allowed}"
    if rounds <= allowed:
        return Verdict("ok", short)
    return Verdict("FAIL", short, [f"the partials reach rank 0 in {rounds} rounds of messages; a tree of merges "
                                   f"takes ceil(log2 P) = {allowed}"],
                   [("tree", "merge as a tree: in round d = 1, 2, 4, ... rank r with r % 2d == d sends its (out, lse) "
                             "to rank r - d, which merges it into its own; after ceil(log2 P) rounds rank 0 holds the "
                             "result (a gather to rank 0, or a chain of merges, takes P - 1)")])
