"""The spec: one validated, hashed description of a call that every entry point takes, and the strategy table.

    python -m pytest -q tests/test_spec.py
    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_spec.py

Serial: what ``Spec.of`` accepts and refuses, its digest, its strategy name,
its plan (the same as ``make_plan``'s) and how options given beside a spec
are judged. Under MPI: every entry point given ``spec=`` returns bit for bit
what it returns for the same keyword arguments, and a spec contradicted by a
keyword raises the same ValueError on every rank.
"""

import numpy as np
import pytest

import mpiring
from mpiring import Spec, make_plan, shard_indices
from mpiring.plans.spec import FIELDS, spec_problem


def test_of_checks_each_field_on_this_rank():
    for keywords, text in [(dict(mode="spiral"), "mode must be one of"), (dict(layout="diagonal"), "layout"),
                           (dict(rotate="q", mode="ulysses"), "nothing to rotate"),
                           (dict(kv_positions=[0, 1]), "kv_positions needs positions"),
                           (dict(scale=-1.0), "scale must be a finite positive number"),
                           (dict(ulysses_size=0), "ulysses_size must be a positive integer"),
                           (dict(seq_len=4.0), "seq_len must be the number of tokens"),
                           (dict(wire_dtype="float8"), "wire_dtype must be None or one of"),
                           (dict(causal="yes"), "causal must be True or False")]:
        with pytest.raises(ValueError, match=text):
            Spec.of(**keywords)
    with pytest.raises(TypeError, match="unknown spec options"):
        Spec.of(causl=True)


def test_a_spec_is_immutable_and_its_digest_follows_its_content():
    a = Spec.of(seq_len=64, causal=True, layout="zigzag", cu_seqlens=[0, 10, 64])
    with pytest.raises(AttributeError):
        a.causal = False
    same = Spec.of(seq_len=64, causal=True, layout="zigzag", cu_seqlens=np.array([0, 10, 64], np.int32))
    assert a.digest == same.digest and len(a.digest) == 16
    for change in (dict(causal=False), dict(cu_seqlens=[0, 11, 64]), dict(scale=0.5), dict(layout="striped"),
                   dict(wire_dtype="bfloat16"), dict(mode="bidirectional"), dict(seq_len=65)):
        assert Spec.of(**dict(a.fields(), **change)).digest != a.digest, change
    p = Spec.of(positions=[3, 1, 2])
    assert p.digest != Spec.of(positions=[1, 2, 3]).digest  # positions by content and order


def test_strategy_names_key_the_table():
    from mpiring.parallel.strategies import STRATEGIES

    cases = {"ring": {}, "bidirectional": dict(mode="bidirectional"), "allgather": dict(mode="allgather"),
             "ulysses": dict(mode="ulysses"), "double_ring": dict(mode="double_ring"),
             "pass-q": dict(rotate="q"), "grid": dict(ulysses_size=2), "sparse": dict(mode="sparse")}
    for name, keywords in cases.items():
        assert Spec.of(**keywords).strategy == name
    assert set(cases) == set(STRATEGIES)
    for mode in ("ring", "bidirectional", "allgather", "ulysses", "double_ring", "sparse"):  # each plan keys it too
        assert make_plan(16, 4, mode=mode).strategy in STRATEGIES
    assert make_plan(16, 4, ulysses_size=2).strategy == "grid"


@pytest.mark.parametrize("keywords", [dict(causal=True, layout="zigzag"), dict(mode="ulysses", causal=True),
                                      dict(ulysses_size=2, layout="striped", window=(3, 0), causal=True),
                                      dict(mode="double_ring", node_size=2, cu_seqlens=[0, 5, 24])])
def test_the_plan_is_make_plans(keywords):
    got, want = Spec.of(seq_len=24, **keywords).plan(4), make_plan(24, 4, **keywords)
    assert type(got) is type(want)
    assert [list(s) for s in got.shards] == [list(s) for s in want.shards]
    assert got.schedule == want.schedule
    with pytest.raises(ValueError, match="the spec says seq_len=24, but the ranks hold 20 tokens"):
        Spec.of(seq_len=24, **keywords).plan(4, 20)


def test_options_beside_a_spec_must_be_its_own():
    spec = Spec.of(causal=True, scale=0.125, window=(4, 0), cu_seqlens=[0, 8, 16])
    assert spec_problem(dict(causal=True, scale=0.125, layout="contiguous", window=None), spec) == (spec, None)
    assert spec_problem(dict(window=[4, 0], cu_seqlens=np.array([0, 8, 16])), spec)[0] is spec
    got, why = spec_problem(dict(scale=0.25), spec)
    assert got is None and why == "scale=0.25 differs from the spec's 0.125: give it in the spec only"
    assert "window=(3, 0) differs from the spec's (4, 0)" in spec_problem(dict(window=(3, 0)), spec)[1]
    assert "cu_seqlens" in spec_problem(dict(cu_seqlens=[0, 9, 16]), spec)[1]
    assert spec_problem({}, "not a spec")[1] == "spec must be an mpiring.Spec, got str"
    filled, why = spec_problem(dict(seq_len=16), spec)  # a field the spec leaves open is filled
    assert why is None and filled.seq_len == 16 and filled.digest == spec.replace(seq_len=16).digest
    assert "decode_attention takes only scale, causal, positions, kv_positions from a spec; this one also sets " \
           "window, cu_seqlens" == spec.beyond(("scale", "causal", "positions", "kv_positions"), "decode_attention")


def test_simulate_takes_a_spec():
    rng = np.random.default_rng(0)
    Q, K, V = (rng.standard_normal((2, 20, 8)) for _ in range(3))
    keywords = dict(causal=True, layout="zigzag", window=(6, 0), wire_dtype="bfloat16")
    want = mpiring.simulate(Q, K, V, 4, **keywords)
    got = mpiring.simulate(Q, K, V, 4, spec=Spec.of(**keywords))
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]) and got[2] == want[2]
    with pytest.raises(ValueError, match="layout='striped' differs from the spec's 'zigzag'"):
        mpiring.simulate(Q, K, V, 4, layout="striped", spec=Spec.of(**keywords))


def test_every_field_is_documented_in_the_module():
    import mpiring.plans.spec as module

    for name in FIELDS:
        assert f"``{name}``" in module.__doc__, name


# ---------------------------------------------------------------------- under MPI


def _inputs(seq_len, heads=4, kv_heads=2, dim=8, seed=3):
    rng = np.random.default_rng(seed)  # the whole arrays from one seed on every rank, then sliced
    q = rng.standard_normal((1, heads, seq_len, dim))
    k, v = (rng.standard_normal((1, kv_heads, seq_len, dim)) for _ in range(2))
    return q, k, v, rng.standard_normal((1, heads, seq_len, dim))


SPECS = [dict(causal=True, layout="zigzag"), dict(mode="bidirectional", window=(5, 0), causal=True),
         dict(mode="allgather", cu_seqlens=[0, 7, 24]), dict(rotate="q", causal=True, layout="striped"),
         dict(mode="ulysses", causal=True), dict(mode="double_ring", causal=True, layout="zigzag"),
         dict(ulysses_size=2, causal=True, layout="zigzag"), dict(causal=True, wire_dtype="bfloat16")]


@pytest.mark.mpi
@pytest.mark.parametrize("keywords", SPECS, ids=lambda k: "-".join(f"{a}={b}" for a, b in k.items()))
def test_every_entry_point_runs_a_spec_as_its_keywords(keywords):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if keywords.get("ulysses_size", 1) > 1 and size % 2:
        pytest.skip("the grid needs an even number of ranks")
    if keywords.get("mode") == "ulysses" and 4 % size:
        pytest.skip("Ulysses needs the heads to split over the ranks")
    S = 24
    q, k, v, dout = _inputs(S)
    rows = shard_indices(S, size, rank, keywords.get("layout", "contiguous"))
    mine = [np.ascontiguousarray(a[..., rows, :]) for a in (q, k, v, dout)]
    spec = Spec.of(**keywords)
    want = mpiring.ring_attention(*mine[:3], comm, **keywords)
    got = mpiring.ring_attention(*mine[:3], comm, spec=spec)
    assert all(np.array_equal(a, b) for a, b in zip(got, want))
    grads = mpiring.ring_attention_backward(mine[3], *mine[:3], *got, comm, spec=spec)
    want_grads = mpiring.ring_attention_backward(mine[3], *mine[:3], *want, comm, **keywords)
    assert all(np.array_equal(a, b) for a, b in zip(grads, want_grads))
    with mpiring.Ring(comm, S, spec=spec) as ring:
        assert ring.spec.digest == spec.replace(seq_len=S).digest
        out, lse = ring.forward(*mine[:3])
        assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])
        assert all(np.array_equal(a, b) for a, b in zip(ring.backward(mine[3], *mine[:3], out, lse), want_grads))
    every = comm.allgather(spec.digest)
    assert every == [spec.digest] * size  # built alike on every rank: the same digest
    held = (q, k, v) if rank == 0 else (None, None, None)  # root holds the full arrays
    full = mpiring.distributed_attention(*held, comm, spec=spec)[0]
    ref = mpiring.distributed_attention(*held, comm, **keywords)[0]
    if rank == 0:
        assert np.array_equal(full, ref)


@pytest.mark.mpi
def test_a_spec_contradicted_by_a_keyword_raises_on_every_rank():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    q, k, v, _ = _inputs(8 * size)
    rows = shard_indices(8 * size, size, comm.Get_rank(), "contiguous")
    mine = [np.ascontiguousarray(a[..., rows, :]) for a in (q, k, v)]
    spec = Spec.of(causal=True)
    wrong = {0: dict(causal=False, layout="zigzag")}.get(comm.Get_rank(), {})  # rank 0 alone contradicts it
    with pytest.raises(ValueError, match="rank 0: layout='zigzag' differs from the spec's 'contiguous'"):
        mpiring.ring_attention(*mine, comm, spec=spec, **wrong)
    with pytest.raises(ValueError, match=f"^ranks? 0.*: q holds 8 tokens, but the contiguous layout of 5 tokens over "
                                         f"{size} ranks gives this rank"):  # the one length check, naming the ranks
        mpiring.ring_attention(*mine, comm, spec=spec.replace(seq_len=5))
    with pytest.raises(ValueError, match="decode_attention takes only scale, causal, positions, kv_positions"):
        mpiring.decode_attention(q[..., :1, :], mine[1], mine[2], comm, spec=Spec.of(layout="zigzag"))
    out, lse = mpiring.decode_attention(q[..., :1, :], mine[1], mine[2], comm, spec=Spec.of(scale=0.3))
    want = mpiring.decode_attention(q[..., :1, :], mine[1], mine[2], comm, scale=0.3)
    assert np.array_equal(out, want[0]) and np.array_equal(lse, want[1])


def test_the_extending_page_runs():
    """docs/extending.md: its examples run and print what the page shows."""
    import doctest
    from pathlib import Path

    page = Path(__file__).resolve().parent.parent / "docs" / "extending.md"
    failures, tried = doctest.testfile(str(page), module_relative=False)
    assert tried >= 7 and failures == 0
