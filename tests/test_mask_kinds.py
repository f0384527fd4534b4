"""A mask kind of one's own: one class, and every strategy, the balancers and the references take it.

    python -m pytest -q tests/test_mask_kinds.py
    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_mask_kinds.py

``Chunked`` below is Llama 4's chunked local attention (a query sees the keys
of its own chunk of ``size`` tokens), written here as a user would, with no
change to the package (docs/extending.md). Its results must match the float64
reference built from its definition, and equal to the bit those of the same
mask said the built-in way (packed documents of ``size`` tokens), forward and
backward, in every strategy.
"""

import numpy as np
import pytest

import mpiring
from mpiring import Spec, shard_indices
from mpiring.plans.visibility import MaskPiece, visible_keys
from mpiring.testing import reference, reference_backward


class Chunked(MaskPiece):
    """Query i sees key j iff both lie in the same chunk of ``size`` tokens."""

    def __init__(self, size):
        self.size = size

    def bounds(self, q_pos):
        first = q_pos // self.size * self.size
        return first, first + self.size - 1

    def allows(self, q_pos, k_pos):
        return q_pos // self.size == k_pos // self.size

    def __repr__(self):
        return f"Chunked({self.size})"


def _documents(S, size):
    return list(range(0, S, size)) + [S]


def test_a_piece_is_one_class_that_the_plans_and_balancers_take():
    S = 37
    pos = np.arange(S)
    chunked = visible_keys(pos, pos, causal=True, mask=(Chunked(8),))
    documents = visible_keys(pos, pos, causal=True, cu_seqlens=np.array(_documents(S, 8)))
    assert all(np.array_equal(a, b) for a, b in zip(chunked, documents))
    plan = Spec.of(seq_len=S, causal=True, layout="zigzag", mask=Chunked(8)).plan(4)
    assert plan.visible_pairs() == mpiring.make_plan(S, 4, causal=True, layout="zigzag",
                                                     cu_seqlens=_documents(S, 8)).visible_pairs()
    parts = mpiring.balance(S, 4, causal=True, mask=(Chunked(8),))
    assert sorted(np.concatenate(parts).tolist()) == list(range(S))
    assert mpiring.plans.balancers.work(parts, S, causal=True, mask=(Chunked(8),)) == \
        mpiring.plans.balancers.work(parts, S, causal=True, cu_seqlens=_documents(S, 8))


def test_a_spec_compares_and_hashes_its_pieces():
    a, b = Spec.of(mask=Chunked(8)), Spec.of(mask=(Chunked(8),))
    assert a.mask == b.mask and a.digest == b.digest
    assert Spec.of(mask=Chunked(4)).digest != a.digest
    with pytest.raises(ValueError, match="mask must be mask pieces"):
        Spec.of(mask=("chunked", 8))


def test_the_reference_reads_the_definition():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 30, 4)) for _ in range(3))
    out, lse = reference(q, k, v, causal=True, mask=(Chunked(7),))
    want, want_lse = reference(q, k, v, causal=True, cu_seqlens=_documents(30, 7))
    assert np.allclose(out, want, atol=1e-14) and np.allclose(lse, want_lse, atol=1e-14)


STRATEGIES = {"ring zigzag": dict(layout="zigzag"), "bidirectional": dict(mode="bidirectional"),
              "allgather": dict(mode="allgather"), "pass-q": dict(rotate="q", layout="striped"),
              "ulysses": dict(mode="ulysses"), "double ring": dict(mode="double_ring"),
              "grid": dict(ulysses_size=2, layout="zigzag"), "sparse": dict(mode="sparse", layout="zigzag")}


@pytest.mark.mpi
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_takes_a_new_kind(name, causal):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    options = STRATEGIES[name]
    if options.get("ulysses_size") and P % 2 or options.get("mode") == "ulysses" and 4 % P:
        pytest.skip("the heads do not split over these ranks")
    S, size = 10 * P + 3, 6
    rng = np.random.default_rng(5)  # whole arrays from one seed on every rank, then this rank's rows
    Q, dO = (rng.standard_normal((1, 4, S, 8)) for _ in range(2))
    K, V = (rng.standard_normal((1, 2, S, 8)) for _ in range(2))
    rows = shard_indices(S, P, rank, options.get("layout", "contiguous"))
    q, k, v, do = (np.ascontiguousarray(a[..., rows, :]) for a in (Q, K, V, dO))
    spec = Spec.of(causal=causal, mask=Chunked(size), **options)
    out, lse = mpiring.ring_attention(q, k, v, comm, spec=spec)
    same = mpiring.ring_attention(q, k, v, comm, causal=causal, cu_seqlens=_documents(S, size), **options)
    assert np.array_equal(out, same[0]) and np.array_equal(lse, same[1])  # the same intervals, the same bits
    ref, ref_lse = reference(q, K, V, causal=causal, mask=(Chunked(size),), q_positions=rows)
    assert np.max(np.abs(out - ref)) < 1e-12 and np.max(np.abs(lse - ref_lse)) < 1e-12
    grads = mpiring.ring_attention_backward(do, q, k, v, out, lse, comm, spec=spec)
    dQ, dK, dV = reference_backward(dO, Q, K, V, causal=causal, mask=(Chunked(size),))
    for got, full in zip(grads, (dQ, dK, dV)):
        assert np.max(np.abs(got - full[..., rows, :])) < 1e-11, name
    with pytest.raises(ValueError, match="lse was made by a forward with other options"):
        mpiring.ring_attention_backward(do, q, k, v, out, lse, comm, spec=spec.replace(mask=(Chunked(size + 1),)))
