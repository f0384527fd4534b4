"""A student's timeline from the strict communicator's ledger: the overlap check, and the ring's trace and plot.

The ledger notes, in order, every request posted ("post"), seen complete ("done"), every blocking
wait ("wait") and, in a counted call, every matrix product ("product", ``flops.Meter``). A send
overlaps the compute when a product was made between its post and its completion: a ring that
starts Isend/Irecv, computes, then waits does; one that computes and then calls
``Sendrecv_replace`` (or Isend followed at once by Wait) does not. The same events become the
records ``mpiring.tools.trace`` and ``plot`` draw for mpiring's own ring.
"""

from .verdicts import Verdict, ranks_text

__all__ = ["overlap_verdict", "records", "sends_overlapped"]


def sends_overlapped(events):
    """``(sends, overlapped)``: sends posted, and those with a product between their post and completion."""
    posted, done, products = {}, {}, []
    for i, e in enumerate(events):
        if e["what"] == "post" and e.get("kind") == "send":
            posted[e["request"]] = i
        elif e["what"] == "done":
            done.setdefault(e["request"], i)
        elif e["what"] == "product":
            products.append(i)
    overlapped = sum(1 for req, i in posted.items()
                     if any(i < p < done.get(req, len(events)) for p in products))
    return len(posted), overlapped


def overlap_verdict(runs):
    """Every rank's every send overlapped some compute; "not judged" when no product could be counted."""
    if runs is None:
        return Verdict("not run")
    if any(r.outcome != "returned" for r in runs):
        return Verdict("not run")
    if not any(e["what"] == "product" for r in runs for e in r.events or []):
        return Verdict("not judged", "products not counted", [
            "no matrix product involved q, k or v as the grader gave them; the overlap check was not judged"])
    counts = [sends_overlapped(r.events or []) for r in runs]
    short = "sends overlapped with compute: " + ", ".join(f"{o}/{s}" for s, o in counts)
    bad = [r for r, (s, o) in enumerate(counts) if o < s]
    if not bad:
        return Verdict("ok", short)
    r = bad[0]
    return Verdict("FAIL", short, [f"{ranks_text(bad)}: {counts[r][0] - counts[r][1]} of {counts[r][0]} sends (rank "
                                   f"{r}) started after the compute of their step or finished before it began"],
                   [("overlap", "overlap the transfer with the compute: post comm.Isend/comm.Irecv of the next block "
                                "before computing on the current one, and wait (MPI.Request.Waitall) after; a "
                                "blocking Sendrecv_replace after the compute leaves the network idle while you "
                                "compute")])


def records(runs):
    """Per rank, the record ``mpiring.tools.trace`` takes: {"rank", "t0", "events": [(name, start, end, info)]}.

    Steps are counted by the waits that completed a receive; consecutive products form one compute
    event. Without counted products, compute is not drawn (only sends and waits).
    """
    out = []
    for rank, run in enumerate(runs):
        events, step, compute = [], 0, None
        recv_requests = {e["request"] for e in run.events or [] if e["what"] == "post" and e.get("kind") == "recv"}
        finished = set()
        for e in run.events or []:
            if e["what"] == "product":
                if compute is None:
                    compute = [e["start"], e["end"]]
                compute[1] = e["end"]
                continue
            if compute is not None:
                events.append(("compute", compute[0], compute[1], {"step": step, "source": f"s{step}",
                                                                    "kind": "full", "stream": 0}))
                compute = None
            if e["what"] == "post" and e.get("kind") == "send":
                events.append(("send", e["t"], e["t"], {"step": step, "dest": e["peer"], "stream": 0}))
            elif e["what"] == "done" and e["request"] in recv_requests:
                finished.add(e["request"])
            elif e["what"] == "wait":
                events.append(("wait", e["start"], e["end"], {"step": step}))
                if finished:
                    step, finished = step + 1, set()
        if compute is not None:
            events.append(("compute", compute[0], compute[1], {"step": step, "source": f"s{step}", "kind": "full",
                                                                "stream": 0}))
        out.append({"rank": rank, "t0": 0.0, "events": events})
    return out
