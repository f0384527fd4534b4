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


def _ring_counts(chain, size, state, both, values, messages):
    """The ring: one state per chunk boundary between two ranks."""
    np.add.at(values, chain.owner[_boundaries(chain)], state)
    np.add.at(messages, chain.owner[_boundaries(chain)], 1)


def _allgather_counts(chain, size, state, both, values, messages):
    """The all-gather: every own chunk's (transition, state) to each of the P-1 others."""
    held = np.bincount(chain.owner, minlength=size)
    values[:], messages[:] = held * both * (size - 1), size - 1


def _scan_counts(chain, size, state, both, values, messages):
    """The scan: MPI_Exscan's rounds where every rank holds one run of the chain, else the log-depth scan."""
    owner, m = chain.owner, len(chain.owner)
    if chain.runs(size) is not None:
        order = list(chain.runs(size))
        for r in range(size):
            rounds = exscan_rounds(order.index(r), size)
            values[r], messages[r] = rounds * both, rounds
        return
    step = 1
    while step < m:
        e = np.arange(m - step)
        away = owner[e + step] != owner[e]
        np.add.at(values, owner[e[away]], both)
        for a, _ in {(int(a), int(b)) for a, b in zip(owner[e[away]], owner[e[away] + step])}:
            messages[a] += 1
        step *= 2
    _ring_counts(chain, size, state, both, values, messages)


def _scan_steps(chain, size):
    """Recursive doubling's rounds, or the log-depth scan's and its shift."""
    if chain.runs(size) is not None:
        return max(size - 1, 0).bit_length()
    return max(len(chain.owner) - 1, 0).bit_length() + 1


COUNTS = {"ring": _ring_counts, "allgather": _allgather_counts, "scan": _scan_counts}  # keyed by MixerSpec.passing
STEPS = {"ring": lambda chain, size: int(np.sum(_boundaries(chain))), "allgather": lambda chain, size: 1,
         "scan": _scan_steps}


def state_counts(plan, passing, state, transition, backward=False):
    """Per rank: ``(values sent, messages)`` of one state pass (forward, or the backward's reverse)."""
    chain, size = plan.chain(reverse=backward), plan.size
    values, messages = np.zeros(size, np.int64), np.zeros(size, np.int64)
    COUNTS[passing](chain, size, state, state + transition, values, messages)
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
    return STEPS[passing](plan.chain(reverse=backward), plan.size)
