"""What crossed between nodes during a call: each host's network counters against the model's inter-node bytes.

    run/cluster run -n 4 python -m mpiring run --seq-len 8192 --causal    # 2 hosts: run reports both

A node is the ranks with one ``MPI.Get_processor_name``; its first rank reads the host's interface counters
(/sys/class/net, all but lo) around the call: every byte on the wire, TCP/IP headers included, so a little
above the payload the model counts (``nodes.inter_node_bytes``).
"""

import os

import numpy as np

from mpiring.cost.nodes import inter_node_bytes, node_ids, traffic
from mpiring.plans.hierarchy import INNER, OUTER

from .cli import poll

__all__ = ["host_sent_bytes", "LinkMeter"]

NET = "/sys/class/net"


def host_sent_bytes():
    """Bytes this host has sent on all its interfaces but loopback (None where /sys/class/net is missing)."""
    try:
        names = [n for n in os.listdir(NET) if n != "lo"]
        return sum(int(open(os.path.join(NET, n, "statistics", "tx_bytes")).read()) for n in names)
    except OSError:
        return None


class LinkMeter:
    """Measures each node's bytes sent between ``start()`` and ``stop()`` (collective calls)."""

    def __init__(self, comm):
        from mpi4py import MPI

        self.comm = comm
        self.node_of = node_ids(comm.allgather(MPI.Get_processor_name()))
        self.nodes = max(self.node_of) + 1
        self.leader = self.node_of.index(self.node_of[comm.Get_rank()]) == comm.Get_rank()
        self._start = None

    def _read(self):
        poll([self.comm.Ibarrier()])  # every rank is here: nothing of the call is still on the wire
        return host_sent_bytes() if self.leader else None

    def start(self):
        self._start = self._read()

    def stop(self):
        """Per node: bytes sent since ``start`` (None where unknown); the same list on every rank."""
        end = self._read()
        mine = None if end is None or self._start is None else end - self._start
        per_rank = self.comm.allgather(mine)
        return [per_rank[self.node_of.index(node)] for node in range(self.nodes)]

    def label(self, records):
        """Name the link of every point-to-point "send" event in ``records`` (``Record.summary()`` dicts).

        The double ring names its own; other modes learn here, from the ranks'
        hosts, whether a transfer stayed inside a node or crossed between nodes.
        """
        for record in records:
            for name, _, _, info in record["events"]:
                if name == "send" and isinstance(info.get("dest"), int) and "link" not in info:
                    same = self.node_of[record["rank"]] == self.node_of[info["dest"]]
                    info["link"] = INNER if same else OUTER

    def report(self, measured, plan, shape, itemsize, backward=False, **wires):
        """Lines comparing ``measured`` (from ``stop``) with the model's inter-node bytes; [] on one node.

        ``wires``: ``wire_dtype`` and ``grad_itemsize``, as ``nodes.traffic`` takes them."""
        if self.nodes < 2:
            return []
        matrix = traffic(plan, **shape, itemsize=itemsize, backward=backward, **wires)
        model = inter_node_bytes(matrix, self.node_of) if matrix else [None] * self.nodes
        lines = [f"inter-node bytes ({self.nodes} nodes; measured: the host's interface counters over the call, "
                 f"TCP/IP headers and acknowledgements included)", "node  ranks  measured sent  model (payload)"]
        for node in range(self.nodes):
            ranks = ",".join(str(r) for r, n in enumerate(self.node_of) if n == node)
            lines.append(f"{node:>4}  {ranks:>5}  {_text(measured[node]):>13}  {_text(model[node]):>15}")
        if all(m is not None for m in model) and all(m is not None for m in measured) and sum(model):
            lines.append(f"measured / model: {np.sum(measured) / np.sum(model):.3f}")
        return lines


def _text(value):
    return "-" if value is None else str(value)
