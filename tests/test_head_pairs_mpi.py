"""``plan.head_pairs`` of a distributed call, on however many ranks the test runs: each rank's row of the plan
its record carries against the definition on its own query rows, and the union the rank's kernel counted.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_head_pairs_mpi.py

Shards come from ``mpiring.shard_indices``; the inputs are drawn whole from one seed on every rank, then sliced.
"""

import numpy as np
import pytest
from flex_cases import B, H, arrays, numpy_fn, rules

import mpiring
from mpiring import masks, shard_indices

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("mode", ["ring", "bidirectional", "sparse"])
@pytest.mark.parametrize("layout, kv_layout", [("zigzag", "zigzag"), ("contiguous", "zigzag")])
@pytest.mark.parametrize("cross", [False, True])
@pytest.mark.parametrize("name", list(rules(1, 1)))
def test_a_ranks_head_pairs_and_the_union_its_kernel_counted(name, cross, layout, kv_layout, mode):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    P, r = comm.Get_size(), comm.Get_rank()
    sq, sk = (4 * P + 3, 6 * P + 1) if cross else (5 * P + 2, None)
    rule, options = rules(sq, sk or sq)[name]
    fn, causal = numpy_fn(rule), options.get("causal", False)
    Q, K, V, _ = arrays(sq, sk or sq, seed=11)
    kv_layout = kv_layout if cross else layout
    i, j = shard_indices(sq, P, r, layout), shard_indices(sk or sq, P, r, kv_layout)
    record = mpiring.Record(r)
    mpiring.ring_attention(Q[..., i, :], K[..., j, :], V[..., j, :], comm, record=record, layout=layout, mode=mode,
                           mask=masks.function(fn, batch=B, heads=H), **options,
                           **(dict(kv_seq_len=sk, kv_layout=kv_layout) if cross else {}))
    q, k = i[:, None], np.arange(sk or sq)[None, :]
    allowed = np.stack([np.stack([np.broadcast_to(fn(b, h, q, k), q.shape[:1] + k.shape[1:]) for h in range(H)])
                        for b in range(B)]) & ((k <= q) if causal else True)
    np.testing.assert_array_equal(record.plan.head_pairs[r], allowed.sum(axis=(-1, -2)))
    assert record.visible_pairs == record.plan.visible_pairs()[r] == int(allowed.any(axis=(0, 1)).sum())
