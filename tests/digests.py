"""Digests of every result, per rank: the before/after record of a refactor that must not change one bit.

    for n in 1 2 3 4; do mpiexec -n $n python tests/digests.py digests-before.json; done
    ... change the code ...
    for n in 1 2 3 4; do mpiexec -n $n python tests/digests.py digests-after.json; done
    python tests/digests.py --compare digests-before.json digests-after.json

Every strategy x layout x mask x dtype, forward and backward, on seeded
inputs sharded with ``shard_indices``: the sha1 of out, lse, dq, dk, dv on
every rank (a case that raises records its message). Each run adds its P's
cases to the JSON file.
"""

import hashlib
import json
import os
import sys

import numpy as np

LAYOUTS = ("contiguous", "zigzag", "striped")
MASKS = {"full": {}, "causal": dict(causal=True), "window": dict(causal=True, window=(5, 0)),
         "documents": dict(cu_seqlens="docs"), "frames": dict(causal=True, causal_block=3)}
DTYPES = ("float64", "float32", "float16", "bfloat16")


def strategies(P):
    """Name -> options of every strategy that runs on P ranks."""
    out = {"ring": dict(mode="ring"), "bidirectional": dict(mode="bidirectional"), "allgather": dict(mode="allgather"),
           "pass-q": dict(mode="ring", rotate="q"), "ulysses": dict(mode="ulysses"),
           "double_ring": dict(mode="double_ring", node_size=2 if P % 2 == 0 else 1), "sparse": dict(mode="sparse")}
    if P % 2 == 0:
        out["grid"] = dict(mode="ring", ulysses_size=2)
    return out


def digest(a):
    a = np.ascontiguousarray(a)
    return hashlib.sha1(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()[:16]


def cases(comm):
    import mpiring
    from mpiring.core.precision import named_dtype

    P, rank = comm.size, comm.rank
    S = 9 * P + 4
    for name, strategy in strategies(P).items():
        for layout in LAYOUTS:
            for mask_name, mask in MASKS.items():
                for dtype_name in DTYPES:
                    if strategy.get("rotate") == "q" and dtype_name in ("float16", "bfloat16"):
                        continue
                    dtype = named_dtype(dtype_name)
                    rng = np.random.default_rng([P, len(name), LAYOUTS.index(layout), len(mask_name)])
                    Q, dO = (rng.standard_normal((1, 2 * P, S, 8)).astype(dtype) for _ in range(2))
                    K, V = (rng.standard_normal((1, P, S, 8)).astype(dtype) for _ in range(2))
                    rows = mpiring.shard_indices(S, P, rank, layout)
                    q, k, v, dout = (np.ascontiguousarray(x[..., rows, :]) for x in (Q, K, V, dO))
                    options = dict(strategy, layout=layout, **mask)
                    if options.get("cu_seqlens") == "docs":
                        options["cu_seqlens"] = [0, S // 3, S // 3, S - 5, S]
                    key = f"P={P} {name} {layout} {mask_name} {dtype_name}"
                    try:
                        out, lse = mpiring.ring_attention(q, k, v, comm, **options)
                        backward = {n: v for n, v in options.items() if n != "rotate"}
                        grads = mpiring.ring_attention_backward(dout, q, k, v, out, lse, comm, **backward)
                        mine = [digest(a) for a in (out, lse, *grads)]
                    except ValueError as exc:
                        mine = f"raises: {exc}"
                    yield key, mine


def record(path):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    found = {key: comm.gather(mine, root=0) for key, mine in cases(comm)}
    if comm.rank == 0:
        table = json.load(open(path)) if os.path.exists(path) else {}
        table.update(found)
        with open(path, "w") as f:
            json.dump(table, f, indent=0, sort_keys=True)
        print(f"{len(found)} cases at P={comm.size} written to {path}")


def compare(before, after):
    old, new = json.load(open(before)), json.load(open(after))
    differ = [key for key in old if key in new and old[key] != new[key]]
    missing = [key for key in old if key not in new]
    for key in differ:
        print(f"differs: {key}\n  before {old[key]}\n  after  {new[key]}")
    for key in missing:
        print(f"missing: {key}")
    print(f"{len(old)} cases before, {len(new)} after: {len(differ)} differ, {len(missing)} missing")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    record(sys.argv[1])
