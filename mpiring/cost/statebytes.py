"""Bytes each rank sends for a sequence mixer: the three state-passing strategies and the convolution's halo. No MPI.

    state_bytes(plan, "scan", state=Z * dk * dv, transition=Z, itemsize=8)     # one number per rank
    halo_bytes(plan, width=4, row=Z * C, itemsize=8)

A recurrence's state is Z x dk x dv values (Z = batch x heads), its
transition Z (one decay per head), Z x dk (one per key dimension) or
Z x dk x dk (the delta rule): neither depends on the sequence length, only
on how many chunks a rank holds (contiguous one, zigzag two, striped one per
token) and on the strategy:

- ring: one state per chunk boundary between two ranks (no transition);
- allgather: every own chunk's (transition, state), to each of the P-1 others
  (as a ring all-gather moves them);
- scan: where every rank holds one run of the chain, MPI_Exscan's recursive
  doubling (one (transition, state) per round with a partner); otherwise the
  log-depth scan: per round one (transition, state) per chunk whose partner
  2^r chunks on is another rank's, then one state per boundary.

The backward passes the states' gradients the same way along the reversed chain.
"""

import numpy as np

__all__ = ["state_bytes", "state_messages", "state_counts", "state_steps", "halo_bytes", "exscan_rounds"]


def exscan_rounds(position, size):
    """Messages a rank sends in a recursive-doubling exclusive scan (MPICH's): partners position ^ 2^k < size."""
    return sum(1 for k in range(max(size - 1, 0).bit_length()) if (position ^ (1 << k)) < size)


def _boundaries(chain):
    """Per element: whether its successor is another rank's and takes what it passes (no cut)."""
    owner, cut = chain.owner, chain.cut
    out = np.zeros(len(owner), bool)
    out[:-1] = (owner[1:] != owner[:-1]) & ~cut[1:]
    return out


def state_counts(plan, passing, state, transition, backward=False):
    """Per rank: ``(values sent, messages)`` of one state pass (forward, or the backward's reverse)."""
    chain, size = plan.chain(reverse=backward), plan.size
    owner, m = chain.owner, len(chain.owner)
    values, messages = np.zeros(size, np.int64), np.zeros(size, np.int64)
    both = state + transition
    if passing == "ring":
        np.add.at(values, owner[_boundaries(chain)], state)
        np.add.at(messages, owner[_boundaries(chain)], 1)
    elif passing == "allgather":
        held = np.bincount(owner, minlength=size)
        values[:], messages[:] = held * both * (size - 1), size - 1
    elif chain.runs(size) is not None:
        order = list(chain.runs(size))
        for r in range(size):
            rounds = exscan_rounds(order.index(r), size)
            values[r], messages[r] = rounds * both, rounds
    else:
        step = 1
        while step < m:
            e = np.arange(m - step)
            away = owner[e + step] != owner[e]
            np.add.at(values, owner[e[away]], both)
            peers = {(int(a), int(b)) for a, b in zip(owner[e[away]], owner[e[away] + step])}
            for a, _ in peers:
                messages[a] += 1
            step *= 2
        np.add.at(values, owner[_boundaries(chain)], state)
        np.add.at(messages, owner[_boundaries(chain)], 1)
    return values, messages


def state_bytes(plan, passing, state, transition, itemsize, backward=False):
    """Bytes each rank sends passing states (``state``, ``transition``: values of one chunk's) as a list."""
    return [int(v) * itemsize for v in state_counts(plan, passing, state, transition, backward)[0]]


def state_messages(plan, passing, state, transition, backward=False):
    """Messages each rank sends passing states, as a list."""
    return [int(v) for v in state_counts(plan, passing, state, transition, backward)[1]]


def halo_bytes(plan, width, row, itemsize, backward=False):
    """Bytes each rank sends for a causal convolution of ``width`` taps: its rows others read; the backward sends
    them again (the weight's gradient reads them) and the gradients of the rows it read back to their holders.
    ``row``: values of one token (batch x channels)."""
    out = []
    for r in range(plan.size):
        halo = plan.halo(width, r)
        rows = sum(len(v) for v in halo.send.values()) + (sum(halo.recv.values()) if backward else 0)
        out.append(rows * row * itemsize)
    return out


def state_steps(plan, passing, backward=False):
    """Messages that follow one another on the longest path of one state pass (its latency in hops): the ring,
    one per chunk boundary between ranks along the chain; the all-gather, one collective; the scan, its rounds
    (recursive doubling's ceil(log2 P), or the log-depth scan's ceil(log2 chunks) and its shift)."""
    chain = plan.chain(reverse=backward)
    if passing == "ring":
        return int(np.sum(_boundaries(chain)))
    if passing == "allgather":
        return 1
    if chain.runs(plan.size) is not None:
        return max(plan.size - 1, 0).bit_length()
    return max(len(chain.owner) - 1, 0).bit_length() + 1
