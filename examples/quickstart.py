"""Ring attention from Python, checked against a plain float64 reference.

    mpiexec -n 4 python examples/quickstart.py

With the .venv that run/demo makes: `. .venv/bin/activate` first (its mpiexec is
the mpich wheel's). Each rank holds one zigzag shard of a causal sequence, the
K/V blocks travel the ring, and every rank checks its own rows.
"""

import numpy as np
from mpi4py import MPI

import mpiring
from mpiring.testing import assert_attention_close, reference

comm = MPI.COMM_WORLD
S, layout = 4096, "zigzag"
rng = np.random.default_rng(0)  # the same seed on every rank: every rank knows the whole problem
Q, K, V = (rng.standard_normal((1, 8, S, 64), dtype=np.float32) for _ in range(3))

# each rank passes only its own shard (..., S/P, dim): two chunks of S/(2P) tokens with zigzag
mine = mpiring.shard_indices(S, comm.size, comm.rank, layout)
q, k, v = (np.ascontiguousarray(x[..., mine, :]) for x in (Q, K, V))
out, lse = mpiring.ring_attention(q, k, v, comm, causal=True, layout=layout)

# check this rank's rows against the dense float64 softmax over the whole sequence
ref, _ = reference(q, K, V, causal=True, q_positions=mine)
assert_attention_close(out, ref, np.float32)
error = comm.allreduce(float(np.max(np.abs(out - ref))), op=MPI.MAX)
if comm.rank == 0:
    print(f"P={comm.size} S={S} causal {layout}: max |out - reference| = {error:.2e} (float32 tolerance 1e-5)")
