"""History independence: a result is the same bits whether its call runs first in a fresh process or after others.

    python -m pytest --with-mpi -q tests/test_history_mpi.py                       # P = 1
    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_history_mpi.py   # and -n 2, 3
    HISTORY_EXAMPLES=400 mpiexec -n 2 python -m pytest ...                         # a longer search

mpiring keeps state between calls: the kernels' scratch and the ring's kept
accumulators and K/V slots (``tiles.scratch``/``filled``), the GEMM backend
and tiles caches, MPI datatype caches, BLAS thread limits, a ``Ring``
handle's own state. Whatever ran before, a call must give the bits it gives
as the first call of a fresh process, and the arrays it returned must keep
them whatever runs after.

The catalogue (``tests/history_catalogue.py``) holds small calls of every
entry point, each a function ``(comm) -> tuple of arrays``; inputs are drawn
whole from a seed per entry and sliced per rank with ``mpiring.shard_indices``,
so every rank of every process computes the same problem. Its ``RAISERS`` are
calls that raise: bad arguments (the same ValueError on every rank), and an
error injected inside the ring at its first or second block, after its kept
buffers were written and with transfers pending.

How "fresh" is established. An entry's fresh bits are its results as the
first mpiring call of a new process. Starting a process per entry under
``mpiexec`` inside the test is too slow, so:

- ``fresh`` (once per session) runs every entry right after
  ``mpiring.release_workspace()``, in catalogue order;
- ``test_fresh_is_a_new_process`` shows these are a new process's bits: at
  P = 1 each entry runs alone in a new process (a fork of a process that has
  imported mpiring and not yet started MPI or called it); under
  ``mpiexec -n P`` a new job of P ranks (rank 0 starts it) runs every entry
  in reverse order, so each entry follows other entries than here, and the
  last one runs first;
- ``test_fresh_matches_float64`` holds them to the float64 reference, so a
  fresh result that is itself wrong is caught;
- ``test_history_independence`` (hypothesis: up to six entries, an optional
  raiser among them, then a target) and ``test_every_pair`` (an Euler walk
  through every ordered pair of entries and raisers; P = 1 only, as it takes
  minutes under mpiexec, and with --full only) then require the fresh bits after every call, and
  again at the end from every array returned on the way.

Ranks must call collectives in the same order: hypothesis is derandomized with
no database, so every rank draws the same sequences, and every check is agreed
over the ranks (``agree``) before it fails, so that all ranks fail, and shrink,
alike.
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from mpi4py import MPI

import mpiring
from mpiring.core.tiles import default_tiles
from mpiring.testing import attention_error

from history_catalogue import HALF, RAISERS, TORCH, bits, build, dtype_of, long_sizes, results, run_fresh

# P = 1 and 2 in the quick suite (the kept state a call leaves does not depend on P beyond 2); --full: every P
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2)]

ROOT = Path(mpiring.__file__).resolve().parents[1]  # the checkout whose mpiring this is
CATALOGUE_SCRIPT = Path(__file__).with_name("history_catalogue.py")


def difference(name, got, want):
    """Why ``got`` is not ``want`` (bits of the same entry), or None."""
    if len(got) != len(want):
        return f"{name}: {len(got)} results, fresh {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if g[:2] != w[:2]:
            return f"{name} result {i}: {g[0]} {g[1]}, fresh {w[0]} {w[1]}"
        if g[2] != w[2]:
            a, b = (np.frombuffer(x[2], np.uint8) for x in (g, w))
            return f"{name} result {i} ({g[0]} {g[1]}): {np.count_nonzero(a != b)} of {a.size} bytes differ"
    return None


def agree(comm, problems):
    """Fail on every rank if any rank found a problem (so that all ranks fail, and shrink, alike)."""
    every = comm.allgather([p for p in problems if p])
    found = [f"rank {r}: {p}" for r, ps in enumerate(every) for p in ps]
    assert not found, "\n".join(found[:12])


COMM = MPI.COMM_WORLD
CATALOGUE = build(COMM.size)
NAMES = list(CATALOGUE)


class Fresh(dict):
    """name -> fresh bits, with a short repr (hypothesis prints the arguments of a failing example)."""

    def __repr__(self):
        return f"<fresh bits of {len(self)} entries>"


@pytest.fixture(scope="module")
def fresh():
    return Fresh(run_fresh(NAMES, COMM))


def test_catalogue_covers_the_entry_points():
    covered = " ".join(NAMES)
    for part_ in ("ulysses", "double_ring", "rotate_q", "zigzag", "striped", "allgather", "bidirectional",
                  "decode", "kvcache", "distributed", "distributed_backward", "simulate", "ring_handle", "b_f16",
                  "long_tiles", "long_keys", "int8_wire") + (("bf16",) if HALF else ()) + (("torch",) if TORCH else ()):
        assert part_ in covered
    long_q, long_k = long_sizes(COMM.size)  # entries f64_long_tiles and b_f32_long_keys
    shortest = [min(len(mpiring.shard_indices(S, COMM.size, r, layout)) for r in range(COMM.size))
                for S, layout in ((long_q, "zigzag"), (long_k, "contiguous"))]
    assert shortest[0] > max(default_tiles(4, np.float64))  # more query rows than a tile, more keys than a tile
    assert shortest[1] > default_tiles(4, np.float32, "bwd")[1]
    assert all(name.startswith("raise_") for name in RAISERS)


def test_fresh_matches_float64(fresh):
    problems = []
    for name, e in CATALOGUE.items():
        results = [np.frombuffer(b, dtype_of(dt)).reshape(shape) for dt, shape, b in fresh[name]]
        checks = e.refs(COMM)
        if len(checks) != len(results):
            problems.append(f"{name}: {len(results)} results, {len(checks)} references")
            continue
        for i, (got, check) in enumerate(zip(results, checks)):
            if check is None:
                continue
            ref, tol, what = check
            err, where = attention_error(got, ref, what)
            if not err <= tol:
                problems.append(f"{name} result {i} ({what}): error {err:.3g} at {where} > {tol:g}")
    agree(COMM, problems)


def _launch_fresh(names, out):
    """Run ``names`` fresh in a new process: at P = 1 each in a fork made before its first call; under mpiexec a
    new job of P ranks (started by rank 0), every name in turn."""
    from launch import clean_env, mpiexec_argv

    env = clean_env(PYTHONPATH=str(ROOT), MPIRING_TUNE_CACHE=os.environ.get("MPIRING_TUNE_CACHE", "off"))
    if COMM.size == 1:
        argv = [sys.executable, CATALOGUE_SCRIPT, out, "--each", *names]
    else:
        argv = mpiexec_argv(COMM.size, sys.executable, CATALOGUE_SCRIPT, out, *names)
    done = subprocess.run(argv, env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr).decode(errors="replace")[-3000:]


def test_fresh_is_a_new_process(fresh):
    """The bits of ``fresh`` are a new process's: at P = 1 each entry alone in a new interpreter; under
    mpiexec a new job running every entry in reverse order (other predecessors, the last entry first)."""
    out = COMM.bcast(tempfile.mkdtemp(prefix="history-") if COMM.rank == 0 else None)
    names = NAMES if COMM.size == 1 else NAMES[::-1]
    failure = None
    if COMM.rank == 0:
        try:
            _launch_fresh(names, out)
        except Exception as exc:  # reported on every rank below
            failure = f"the fresh process failed: {exc}"
    request = COMM.Ibarrier()  # the others wait without spinning: the new job needs the cores
    while not request.Test():
        time.sleep(0.02)
    agree(COMM, [COMM.bcast(failure)])
    problems = []
    for name in names:
        try:
            with open(os.path.join(out, f"{name}.{COMM.rank}.pickle"), "rb") as f:
                problems.append(difference(name, fresh[name], pickle.load(f)))
        except OSError as exc:
            problems.append(f"{name}: no result from the fresh process ({exc})")
    COMM.Barrier()
    if COMM.rank == 0:
        shutil.rmtree(out)
    agree(COMM, problems)


def test_used_handle_equals_a_new_one(fresh):
    """A Ring handle's own state: after another problem and a call that raised, a call gives a new handle's bits."""
    agree(COMM, [difference("ring_handle_used", fresh["ring_handle_used"], fresh["ring_handle"])])


def check_after(history, target, fresh):
    """Run ``history`` (entries and raisers), then ``target``: every entry's bits must be its fresh ones, right
    after its call and still at the end (results are new arrays: no later call may write into them)."""
    calls = history + [target]
    problems, held = [], []
    for i, name in enumerate(calls):
        arrays = results(name, COMM)
        if arrays is not None:
            label = f"call {i + 1} of {len(calls)} (after {calls[i - 1] if i else 'nothing'}): {name}"
            problems.append(difference(label, bits(arrays), fresh[name]))
            held.append((label, name, arrays))
    problems += [difference(f"{label}, held to the end", bits(arrays), fresh[name]) for label, name, arrays in held]
    sequence = f"in {calls}: " if len(calls) <= 10 else ""
    agree(COMM, [sequence + p for p in problems if p])


HYPOTHESIS = settings(derandomize=True, database=None, max_examples=int(os.environ.get("HISTORY_EXAMPLES", 60)),
                      deadline=None, suppress_health_check=list(HealthCheck),
                      phases=(Phase.explicit, Phase.generate, Phase.shrink))


@HYPOTHESIS
@given(history=st.lists(st.sampled_from(NAMES), min_size=1, max_size=6),
       raiser=st.none() | st.tuples(st.integers(0, 6), st.sampled_from(list(RAISERS))),
       target=st.sampled_from(NAMES))
def test_history_independence(fresh, history, raiser, target):
    if raiser is not None:
        history = history[:raiser[0]] + [raiser[1]] + history[raiser[0]:]
    check_after(history, target, fresh)


def pairs_walk(names):
    """A walk through ``names`` that takes every ordered pair (a, b), a == b too, as consecutive calls once."""
    unused = {a: list(names) for a in names}
    stack, walk = [names[0]], []
    while stack:  # Hierholzer: an Euler circuit of the complete directed graph with loops
        a = stack[-1]
        if unused[a]:
            stack.append(unused[a].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]


@pytest.mark.full  # quick suite: test_history_independence's histories of the same entries and raisers, P = 1, 2
@pytest.mark.skipif(COMM.size > 1, reason="all ordered pairs take minutes under mpiexec; P = 1 only")
def test_every_pair(fresh):
    """Every entry right after every entry and every raiser: an Euler walk over all ordered pairs."""
    walk = pairs_walk(NAMES + list(RAISERS))
    check_after(walk[:-1], walk[-1], fresh)
