"""The sparse movement (each K/V block straight to the ranks that need it) against the reference, on P ranks.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_sparse_mpi.py

Every layout, every mask kind and some of their intersections, from one token
per rank up to uneven shards; every rank checks its own out, lse, dq, dk, dv
against the dense float64 reference, its bytes against the cost model, its
messages and recorded tasks against the plan (``modecheck.check_mode``), and
its sends against the graph of needed blocks.
"""

import pytest
from modecheck import check_mode
from modecheck import problem as _problem

from mpiring import LAYOUTS

pytestmark = pytest.mark.mpi

MASKS = {"full": {}, "causal": dict(causal=True), "window": dict(causal=True, window=(3, 0)),
         "two-sided window": dict(window=(2, 2)), "documents": dict(cu_seqlens="docs"),
         "frames": dict(causal=True, causal_block=3), "window + documents": dict(window=(2, 1), cu_seqlens="docs")}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", MASKS)
def test_forward_and_backward_match_reference(comm, rng, layout, mask):
    P = comm.size
    for S in sorted({P, 2 * P + 1, 5 * P + 3}):  # one token per rank, uneven shards, longer ones
        if MASKS[mask].get("cu_seqlens") and S < 6:
            continue  # the documents [0, 2, 2, S - 4, S] need S >= 6
        arrays = _problem(rng, S, 4, 2)
        options = dict(layout=layout, mode="sparse", **MASKS[mask])
        fwd, bwd = check_mode(comm, *arrays, options, f"{mask} S={S}")
        plan, r = fwd.plan, comm.rank
        for rec, backward in ((fwd, False), (bwd, True)):
            sends = [(e[3]["step"], e[3]["dest"]) for e in rec.events if e[0] == "send"]
            assert sends == [(step, dest) for step, dest, _, _ in plan.sends(r, backward)], (mask, S)
