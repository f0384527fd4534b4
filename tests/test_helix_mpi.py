"""Helix decoding: K/V sharded by sequence over KVP groups, heads split over TP, one all-to-all (and HOP-B).

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_helix_mpi.py

Each rank's heads are checked against the dense float64 reference over the
whole cache and all heads; ranks of a grid hold different heads, so the
check is per rank, and the same call with and without HOP-B (``chunks``)
must give the same bits.
"""

import numpy as np
import pytest
from test_kvcache_mpi import _error_everywhere

from mpiring import HelixGrid, Record, helix_attention
from mpiring.testing import assert_attention_close, reference

pytestmark = pytest.mark.mpi


def _grids(size, Hq, Hk):
    """Every TP that divides P and the K/V heads, with Hq / TP a multiple of KVP = P / TP."""
    return [tp for tp in range(1, size + 1) if size % tp == 0 and Hk % tp == 0 and (Hq // tp) % (size // tp) == 0]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("S,T", [(37, 1), (2, 2)])  # S = 2: at P = 3, 4 some shards are empty
def test_helix_matches_reference(comm, dtype, S, T):
    B, Hq, Hk, D = 4, 24, 12, 8  # heads divide every TP x KVP of P = 1..4
    rng = np.random.default_rng([S, T])
    Q = rng.standard_normal((B, Hq, T, D)).astype(dtype)
    K, V = (rng.standard_normal((B, Hk, S, D)).astype(dtype) for _ in range(2))
    ref, ref_lse = reference(Q, K, V)
    for tp in _grids(comm.size, Hq, Hk):
        with HelixGrid(comm, tp) as grid:
            kvp = grid.kvp_size
            mine = np.flatnonzero(np.arange(S) // 2 % kvp == grid.kvp_rank)  # interleave 2 over the KVP group
            hq, hk = Hq // tp, Hk // tp
            q = Q[:, grid.tp_rank * hq:(grid.tp_rank + 1) * hq]
            k, v = (X[:, grid.tp_rank * hk:(grid.tp_rank + 1) * hk][..., mine, :] for X in (K, V))
            heads = slice(grid.tp_rank * hq + grid.kvp_rank * hq // kvp, grid.tp_rank * hq + (grid.kvp_rank + 1)
                          * hq // kvp)
            results = []
            for chunks in (1, 2, 4):
                rec = Record(comm.rank)
                out, lse = helix_attention(q, k, v, grid, chunks=chunks, record=rec)
                assert out.dtype == dtype and out.shape == (B, hq // kvp, T, D)
                assert_attention_close(out, ref[:, heads], dtype, f"out tp={tp} chunks={chunks}")
                assert_attention_close(lse, ref_lse[:, heads], dtype, f"lse tp={tp} chunks={chunks}")
                assert rec.bytes_sent == (kvp - 1) * B * (hq // kvp) * T * (D + 1) * 8  # the model's bytes
                results.append(out.tobytes() + lse.tobytes())
            assert results[0] == results[1] == results[2]  # HOP-B changes the schedule, not one bit


def test_helix_refuses_bad_input_on_every_rank(comm):
    message = _error_everywhere(comm, lambda: HelixGrid(comm, comm.size + 1))
    assert message.endswith(f"tp must be a positive divisor of the {comm.size} ranks, got {comm.size + 1}")
    with HelixGrid(comm, 1) as grid:
        q = np.zeros((2, 3 * comm.size, 1, 8))
        k = v = np.zeros((2, 1, 3, 8))
        bad = 3 if comm.rank == comm.size - 1 else 1
        message = _error_everywhere(comm, lambda: helix_attention(q, k, v, grid, chunks=bad))
        assert message.endswith(f"rank {comm.size - 1}: chunks must be an integer from 1 to the batch (2), got 3")
        assert comm.allreduce(1) == comm.size
