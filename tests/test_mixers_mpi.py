"""The sequence mixers through real MPI: every mixer x state-passing strategy x layout x documents, exact.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_mixers_mpi.py     # also -n 1, 2, 3 (and 8, 16)

Each rank holds its shard (``mpiring.shard_indices``, or random explicit
positions: whole runs or single tokens, unsorted) of inputs drawn from one
seed; its outputs and gradients are compared with the float64 token-by-token
loops of ``mpiring.core.mixers.sequential`` on the whole sequence, and the
bytes and messages it sent with the byte model (``mpiring.cost.statebytes``).
Sizes: one token per rank, uneven lengths, and runs past several blocks.
A chain combined in rank order, and maps composed the wrong way round, are
planted and shown to be caught; bad input raises the same ValueError on every rank.
"""

import numpy as np
import pytest
from mpi4py import MPI
from test_positions_mpi import random_partition

from mpiring import (
    LAYOUTS,
    MixerSpec,
    Record,
    causal_conv,
    causal_conv_backward,
    linear_attention,
    linear_attention_backward,
    selective_scan,
    selective_scan_backward,
    shard_indices,
    ssd,
    ssd_backward,
)
from mpiring.core.mixers.sequential import conv, conv_backward, recurrence, recurrence_backward
from mpiring.core.mixers.ssm import RecurrenceGrads, scan_grads, scan_inputs, ssd_grads, ssd_inputs
from mpiring.cost.statebytes import halo_bytes, state_bytes, state_messages
from mpiring.plans.chunks import Chain, MixerPlan

from conftest import sweep

pytestmark = pytest.mark.mpi

PASSINGS = ("ring", "allgather", "scan")
# name: (kind of the recurrence, its decay, beta); conv has no state to pass
RECURRENCES = {"linear": (None, False), "decay": ("head", False), "gla": ("key", False), "gdn": ("head", True),
               "ssd": ("ssd", False), "mamba": ("scan", False)}
Bz, H, DK, DV, C, WIDTH = 2, 2, 3, 2, 3, 4


def sizes(P):
    """(S, block): one token per rank, uneven, and runs of several blocks of 4."""
    return [(P, None), (4 * P + 3, None), (3 * 4 * P + 1, 4)]


def cases(P, rng, size=None):
    """(S, options, this rank's positions, documents) over every layout, explicit positions and documents; of
    every size, or of ``sizes(P)[size]``."""
    rank = MPI.COMM_WORLD.rank
    for S, block in sizes(P) if size is None else sizes(P)[size:size + 1]:
        for cu in (None, sorted({0, 1, S // 2, S})):
            extra = dict(cu_seqlens=cu, block=block)
            for layout in LAYOUTS:
                yield S, dict(seq_len=S, layout=layout, **extra), shard_indices(S, P, rank, layout), cu
            for chunky in (True, False):
                if S > P:
                    mine = random_partition(S, P, rng, chunky)[rank]
                    yield S, dict(positions=mine, **extra), mine, cu


def close(got, want, tol=1e-12, what=""):
    err = float(np.max(np.abs(np.asarray(got) - want))) if np.size(want) else 0.0
    assert err <= tol * max(1.0, float(np.max(np.abs(want)))), f"{what}: error {err:.3g}"


class Checks:
    """Assertions of one case gathered, then failed on every rank together (no rank is left waiting in the
    next case's collective call while another has left the test)."""

    def __init__(self, comm):
        self.comm, self.failed = comm, []

    def close(self, got, want, tol=1e-12, what=""):
        try:
            close(got, want, tol, what)
        except AssertionError as exc:
            self.failed.append(str(exc))

    def equal(self, got, want, what):
        if got != want:
            self.failed.append(f"{what}: {got} != {want}")

    def done(self):
        every = self.comm.allgather(self.failed)
        self.failed = []
        assert not any(every), "; ".join(f"rank {r}: {f}" for r, fails in enumerate(every) for f in fails)


def starts_of(S, cu):
    return None if cu is None else np.isin(np.arange(S), cu[:-1])


def draw(rng, name, S):
    """The whole sequence's inputs of a recurrence, in the entry point's shapes."""
    kind, beta = RECURRENCES[name]
    if kind == "ssd":
        return dict(x=rng.standard_normal((Bz, 2 * H, S, DV)), dt=rng.random((Bz, 2 * H, S)), A=-rng.random(2 * H),
                    B=rng.standard_normal((Bz, H, S, DK)), C=rng.standard_normal((Bz, H, S, DK)),
                    D=rng.standard_normal(2 * H))
    if kind == "scan":
        return dict(x=rng.standard_normal((Bz, C, S)), dt=rng.random((Bz, C, S)), A=-rng.random((C, DK)),
                    B=rng.standard_normal((Bz, S, DK)), C=rng.standard_normal((Bz, S, DK)), D=rng.standard_normal(C))
    q, k, v = (rng.standard_normal((Bz, H, S, d)) for d in (DK, DK, DV))
    if beta:
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
    decay = {None: None, "head": -rng.random((Bz, H, S)), "key": -rng.random((Bz, H, S, DK))}[kind]
    return dict(q=q, k=k, v=v, decay=decay, beta=rng.random((Bz, H, S)) if beta else None)


AXES = {"q": -2, "k": -2, "v": -2, "x": -2, "dt": -1, "B": -2, "C": -2, "beta": -1}


def axis(name, kind, a):
    if name == "decay":
        return -2 if a.ndim == 4 else -1
    if kind == "scan" and name in ("x", "dt"):
        return -1
    return AXES.get(name)


def reference(name, arrays, dy, starts):
    """Outputs and gradients of the whole sequence by the float64 loops (through the state-space mappings)."""
    kind, _ = RECURRENCES[name]
    if kind in ("ssd", "scan"):
        inputs, grads = (ssd_inputs, ssd_grads) if kind == "ssd" else (scan_inputs, scan_grads)
        q, k, v, g = inputs(*(arrays[n] for n in "x dt A B C".split()))
        beta, scale = None, 1.0
    else:
        q, k, v, g, beta = (arrays[n] for n in ("q", "k", "v", "decay", "beta"))
        scale = 1 / np.sqrt(DK)
    Z, S = int(np.prod(v.shape[:-2])), v.shape[-2]
    flat = [None if a is None else np.reshape(a, (Z, S) + a.shape[v.ndim - 1:]) for a in (q * scale, k, v, g, beta)]
    out = recurrence(*flat[:3], g=flat[3], beta=flat[4], starts=starts)[0].reshape(v.shape)
    dout = (dy[..., None] if kind == "scan" else dy).reshape(flat[2].shape)
    dq, dk, dv, dg, db, _ = recurrence_backward(dout, *flat[:3], g=flat[3], beta=flat[4], starts=starts)
    if kind not in ("ssd", "scan"):
        return out, [dq.reshape(q.shape) * scale, dk.reshape(k.shape), dv.reshape(v.shape),
                     None if g is None else dg.reshape(g.shape), None if beta is None else db.reshape(beta.shape)]
    x = arrays["x"]
    y = (out[..., 0] if kind == "scan" else out) + (arrays["D"][:, None] if kind == "scan" else
                                                    arrays["D"][:, None, None]) * x
    parts = [a.reshape(p.shape) for a, p in zip((dq, dk, dv, dg), (q, k, v, g))]
    return y, list(grads(RecurrenceGrads(*parts), dy, x, arrays["dt"], arrays["A"], arrays["B"], arrays["D"]))


def run(name, local, dy, options, fwd_rec, bwd_rec):
    kind, _ = RECURRENCES[name]
    if kind in ("ssd", "scan"):
        forward, backward = (ssd, ssd_backward) if kind == "ssd" else (selective_scan, selective_scan_backward)
        y, carry = forward(**local, comm=MPI.COMM_WORLD, record=fwd_rec, **options)
        return y, backward(dy, **local, carry=carry, comm=MPI.COMM_WORLD, record=bwd_rec, **options)
    y, carry = linear_attention(local["q"], local["k"], local["v"], MPI.COMM_WORLD, decay=local["decay"],
                                beta=local["beta"], record=fwd_rec, **options)
    return y, linear_attention_backward(dy, local["q"], local["k"], local["v"], carry, MPI.COMM_WORLD,
                                        decay=local["decay"], beta=local["beta"], record=bwd_rec, **options)


def state_size(name, arrays):
    """(state values, transition values) of one chunk's map."""
    kind, beta = RECURRENCES[name]
    if kind == "ssd":
        return Bz * 2 * H * DK * DV, Bz * 2 * H
    if kind == "scan":
        return Bz * C * DK, Bz * C * DK
    Z = Bz * H
    return Z * DK * DV, Z * DK * DK if beta else Z * DK if kind == "key" else Z


def check_recurrence(name, passing, rng, comm, size=None):
    """One mixer and strategy over every case (of one size): results, gradients, bytes and messages."""
    P, rank = comm.size, comm.rank
    kind, _ = RECURRENCES[name]
    for S, options, mine, cu in cases(P, rng, size):
        arrays = draw(rng, name, S)
        out_axis = -1 if kind == "scan" else -2
        full_dy = rng.standard_normal(arrays["x" if "x" in arrays else "v"].shape)
        ref_out, ref_grads = reference(name, arrays, full_dy, starts_of(S, cu))
        local = {n: a if a is None or axis(n, kind, a) is None else np.take(a, mine, axis=axis(n, kind, a))
                 for n, a in arrays.items()}
        dy = np.take(full_dy, mine, axis=out_axis)
        records = Record(), Record()
        what = f"{name} {passing} S={S} {options.get('layout', 'positions')} cu={cu}"
        out, grads = run(name, local, dy, dict(options, passing=passing), *records)
        check = Checks(comm)
        check.close(out, np.take(ref_out, mine, axis=out_axis), what=f"{what}: out")
        names = list(arrays)[:len(grads)]
        for n, got, want in zip(names, grads, ref_grads):
            check.equal(got is None, want is None, f"{what}: d{n} given")
            if got is None or want is None:
                continue
            if axis(n, kind, arrays[n]) is None:  # a weight every rank shares: each rank's share, summed
                check.close(comm.allreduce(got), want, what=f"{what}: d{n}")
            else:
                check.close(got, np.take(want, mine, axis=axis(n, kind, arrays[n])), what=f"{what}: d{n}")
        plan = MixerSpec.of(**dict(options, passing=passing, positions=None, seq_len=S)).plan(
            P, positions=[np.asarray(p) for p in comm.allgather(mine)] if "positions" in options else None)
        state, transition = state_size(name, arrays)
        for rec, back in zip(records, (False, True)):
            check.equal(rec.bytes_sent, state_bytes(plan, passing, state, transition, 8, back)[rank], f"{what} bytes")
            if passing != "scan" or plan.chain(back).runs(P) is None:
                check.equal(rec.messages, state_messages(plan, passing, state, transition, back)[rank],
                            f"{what} messages")
        check.done()


# each mixer meets each strategy at one of the sizes (one token per rank, uneven, runs of blocks), every layout,
# positions and documents; --full: every mixer x strategy x size
@pytest.mark.parametrize(*sweep(name=list(RECURRENCES), passing=list(PASSINGS), size=[0, 1, 2]))
def test_recurrences_are_exact(name, passing, size, rng):
    check_recurrence(name, passing, rng, MPI.COMM_WORLD, size)


def test_causal_conv_is_exact(rng):
    comm = MPI.COMM_WORLD
    P, rank = comm.size, comm.rank
    for S, options, mine, cu in cases(P, rng):
        x, weight, bias, dy = (rng.standard_normal((Bz, S, C)), rng.standard_normal((C, WIDTH)), rng.standard_normal(C),
                               rng.standard_normal((Bz, S, C)))
        starts = starts_of(S, cu)
        records = Record(), Record()
        local = np.take(x, mine, axis=-2)
        y = causal_conv(local, weight, bias, comm, record=records[0], **options)
        dx, dweight, dbias = causal_conv_backward(np.take(dy, mine, axis=-2), local, weight, bias, comm,
                                                  record=records[1], **options)
        what = f"conv S={S} {options.get('layout', 'positions')} cu={cu}"
        check = Checks(comm)
        check.close(y, np.take(conv(x, weight, bias, starts), mine, axis=-2), what=f"{what}: y")
        want_dx, want_dweight, want_dbias = conv_backward(dy, x, weight, bias, starts)
        check.close(dx, np.take(want_dx, mine, axis=-2), what=f"{what}: dx")
        check.close(comm.allreduce(dweight), want_dweight, what=f"{what}: dweight")
        check.close(comm.allreduce(dbias), want_dbias, what=f"{what}: dbias")
        plan = MixerSpec.of(seq_len=S, cu_seqlens=cu, layout=options.get("layout", "contiguous")).plan(
            P, positions=[np.asarray(p) for p in comm.allgather(mine)] if "positions" in options else None)
        for rec, back in zip(records, (False, True)):
            check.equal(rec.bytes_sent, halo_bytes(plan, WIDTH, Bz * C, 8, back)[rank], f"{what} bytes")
        check.done()


def test_float32_inputs(rng):
    comm = MPI.COMM_WORLD
    S = 5 * comm.size + 2
    q, k, v = (rng.standard_normal((Bz, H, S, d)).astype(np.float32) for d in (DK, DK, DV))
    g = -rng.random((Bz, H, S, DK)).astype(np.float32)
    mine = shard_indices(S, comm.size, comm.rank, "zigzag")
    out, _ = linear_attention(*(np.take(a, mine, axis=-2) for a in (q, k, v)), comm, decay=np.take(g, mine, axis=-2),
                              seq_len=S, layout="zigzag", passing="scan")
    want = recurrence(*(a.reshape(Bz * H, S, -1) for a in (q / np.sqrt(DK), k, v)), g=g.reshape(Bz * H, S, DK))[0]
    assert out.dtype == np.float32
    close(out, np.take(want.reshape(Bz, H, S, DV), mine, axis=-2), tol=1e-5)


def _rank_order(chain):
    def mutated(self, reverse=False):
        got = chain(self, reverse)
        order = np.argsort(got.owner, kind="stable")
        return Chain(got.chunk[order], got.owner[order], got.cut[order])
    return mutated


def _swapped(compose):
    return lambda later, earlier: compose(earlier, later)


@pytest.mark.parametrize("passing", PASSINGS)
@pytest.mark.parametrize("plant", ["rank order", "swapped compose"])
def test_a_planted_wrong_state_order_is_caught(plant, passing, rng, monkeypatch):
    """Combining zigzag's chunks in rank order (or composing maps the wrong way round) gives results the checks
    above reject on some rank; without the plant the same call passes them."""
    from mpiring.parallel.mixing import passing as passing_module

    comm = MPI.COMM_WORLD
    if comm.size < 2 or (plant == "swapped compose" and passing != "scan"):
        pytest.skip("one rank has one chunk; only the scan composes maps")
    S = 4 * comm.size + 3
    arrays = draw(rng, "gla", S)
    ref, _ = reference("gla", arrays, np.zeros((Bz, H, S, DV)), None)
    mine = shard_indices(S, comm.size, comm.rank, "zigzag")
    local = [np.take(arrays[n], mine, axis=-2) for n in ("q", "k", "v", "decay")]

    def error():
        out, _ = linear_attention(*local[:3], comm, decay=local[3], seq_len=S, layout="zigzag", passing=passing)
        try:
            close(out, np.take(ref, mine, axis=-2))
            return 0.0
        except AssertionError:
            return 1.0

    assert comm.allreduce(error(), op=MPI.MAX) == 0.0
    if plant == "rank order":
        monkeypatch.setattr(MixerPlan, "chain", _rank_order(MixerPlan.chain))
    else:
        monkeypatch.setattr(passing_module, "compose", _swapped(passing_module.compose))
    assert comm.allreduce(error(), op=MPI.MAX) == 1.0, "the planted order went unnoticed"


def agreed_error(call):
    """The ValueError ``call()`` raises on this rank, checked to be every rank's."""
    try:
        call()
    except ValueError as exc:
        message = str(exc)
    else:
        message = None
    every = MPI.COMM_WORLD.allgather(message)
    assert message is not None and len(set(every)) == 1, every
    return message


def test_bad_input_is_every_ranks_error(rng):
    comm = MPI.COMM_WORLD
    P, rank, S = comm.size, comm.rank, 3 * comm.size + 1
    q, k, v = (rng.standard_normal((1, H, S, DK)) for _ in range(3))
    mine = shard_indices(S, P, rank, "zigzag")
    local = [np.take(a, mine, axis=-2) for a in (q, k, v)]
    last = P - 1
    bad_v = local[2][..., 1:, :] if rank == last else local[2]  # one token short
    message = agreed_error(lambda: linear_attention(local[0], local[1], bad_v, comm, seq_len=S, layout="zigzag"))
    assert f"rank {last}" in message and " v " in message
    assert "passing" in agreed_error(lambda: linear_attention(*local, comm, seq_len=S, layout="zigzag",
                                                               passing="tree"))
    assert "cu_seqlens" in agreed_error(lambda: linear_attention(*local, comm, seq_len=S, layout="zigzag",
                                                                  cu_seqlens=[0, 2, S + 1]))
    overlap = np.concatenate([mine, mine[:1]]) if rank == last else mine  # a position held twice
    rows = [np.take(a, overlap, axis=-2) for a in (q, k, v)]
    assert "position" in agreed_error(lambda: linear_attention(*rows, comm, positions=overlap))
    out, carry = linear_attention(*local, comm, seq_len=S, layout="zigzag")
    assert "carry" in agreed_error(lambda: linear_attention_backward(out, *local, carry, comm, seq_len=S,
                                                                      layout="zigzag", passing="ring"))
    x = rng.standard_normal((1, len(mine), C))
    weight = rng.standard_normal((C + (rank == last), WIDTH))  # one channel too many on the last rank
    assert "weight" in agreed_error(lambda: causal_conv(x, weight, None, comm, seq_len=S, layout="zigzag"))
    decay = -rng.random((1, H, len(mine), DK))
    assert "one decay per head" in agreed_error(lambda: linear_attention(*local, comm, decay=decay,
                                                                          beta=rng.random((1, H, len(mine))),
                                                                          seq_len=S, layout="zigzag"))


def test_spec_with_timeout_and_record_runs_as_the_options(rng):
    comm = MPI.COMM_WORLD
    S = 2 * comm.size + 1
    q, k, v = (np.take(rng.standard_normal((1, H, S, DK)), shard_indices(S, comm.size, comm.rank, "zigzag"), axis=-2)
               for _ in range(3))
    record = Record(comm.rank)
    spec = MixerSpec.of(seq_len=S, layout="zigzag", passing="ring")
    got, _ = linear_attention(q, k, v, comm, spec=spec, timeout=60.0, record=record)
    want, _ = linear_attention(q, k, v, comm, seq_len=S, layout="zigzag", passing="ring")
    assert np.array_equal(got, want) and (record.messages > 0) == (comm.size > 1)
    assert "beside spec" in agreed_error(lambda: linear_attention(q, k, v, comm, spec=spec, seq_len=S))
    assert "timeout" in agreed_error(lambda: linear_attention(q, k, v, comm, seq_len=S, layout="zigzag", timeout=-1))
