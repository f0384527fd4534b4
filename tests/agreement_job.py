"""Every entry point that communicates, with one option or datum differing on one rank, or one rank failing: one job.

    mpiexec -n 3 python tests/agreement_job.py                 # every case, one JSON line each
    mpiexec -n 3 python tests/agreement_job.py --cases 3 17    # some of them
    python tests/agreement_job.py --table                      # the table of docs/reliability.md §1b

In each case rank b = P - 1 passes something the others do not (an option, a
tensor, a function's data) or fails in its own checks (bad input, a user's
function raising); every rank must raise the same ValueError, whose text
contains the case's expected words ({b}: the odd rank, {P}: the ranks), in
bounded time, with the default ``timeout="auto"`` unless the case says. The
ranks meet in a blocking barrier between cases, so a case that leaves a rank
waiting hangs the job, and the test's limit ends it (tests/test_agreement.py).
Rank 0 prints ``{"case", "outcomes": [per rank], "seconds": [per rank]}`` per case.
"""

import argparse
import functools
import importlib.util
import json
import sys
import time

import numpy as np

H, D = 2, 8
GLOBAL_FLAGS = np.zeros(10_000, bool)  # read by ``global_mask``: rank b flips one entry


def global_mask(q, k):
    return GLOBAL_FLAGS[k] | (k <= q)


def keep_causal(q, k):
    return k <= q


def keep_all(q, k):
    return k >= 0


def window_mask(width):
    def windowed(q, k, width=width):  # the same code whatever the width: only the default differs
        return (k <= q) & (k > q - width)
    return windowed


class Near:
    """A callable mask object: keys within ``width`` before the query."""

    def __init__(self, width):
        self.width = width

    def __call__(self, q, k):
        return (k <= q) & (k > q - self.width)


class Case:
    """What a case runs on: the communicator, who is odd (b = P - 1), and seeded inputs sharded by shard_indices."""

    def __init__(self, comm):
        import mpiring

        self.comm, self.rank, self.P = comm, comm.Get_rank(), comm.Get_size()
        self.b = self.P - 1
        self.odd = self.rank == self.b
        self.S = 4 * self.P
        rng = np.random.default_rng(0)
        self.Q, self.K, self.V, self.dO = (rng.standard_normal((1, H, self.S, D)) for _ in range(4))
        self.i = mpiring.shard_indices(self.S, self.P, self.rank)
        self.q, self.k, self.v, self.do = (a[..., self.i, :] for a in (self.Q, self.K, self.V, self.dO))

    def pick(self, same, odd):
        return odd if self.odd else same


def _flags(c, flip):
    """A 10,000-entry torch bool tensor, one element flipped on rank b when ``flip``."""
    import torch

    flags = torch.zeros(10_000, dtype=torch.bool)
    if flip and c.odd:
        flags[5177] = True
    return flags


def _closure_mask(flags):
    def flagged(q, k):
        return flags.numpy()[k] | (k <= q)
    return flagged


def _listed(tables):
    def listed(q, k):
        return (tables[0][k] > -1) & (k <= q)
    return listed


def _bias_of(slopes):
    def sloped(h, q, k):
        return slopes[h] * (k - q)
    return sloped


def _pair_bias(hit):
    def pair_bias(h, q, k):  # fails at one (query, key) pair only: inside the ring, not in the probes
        if np.any((q == hit[0]) & (k == hit[1])):
            raise ArithmeticError(f"no bias for the pair {hit}")
        return np.zeros(np.broadcast_shapes(np.shape(h), np.shape(q), np.shape(k)))
    return pair_bias


def _nan_bias(hit):
    def nan_bias(h, q, k):  # NaN at one (query, key) pair, inside the ring
        return np.where((q == hit[0]) & (k == hit[1]), np.nan, 0.0) + 0 * h
    return nan_bias


def _ring(c, **options):
    import mpiring

    return mpiring.ring_attention(c.q, c.k, c.v, c.comm, **options)


def _global_case(c):
    GLOBAL_FLAGS[617] = c.odd
    try:
        _ring(c, mask=_masks().function(global_mask))
    finally:
        GLOBAL_FLAGS[617] = False


def _masks():
    from mpiring import masks

    return masks


def _mid_ring_bias(c, timeout):
    """A bias failing at one pair that only the rank holding query S - 2 meets, inside the ring."""
    _ring(c, causal=True, bias=_pair_bias((c.S - 2, 1)), timeout=timeout)


def _backward(c, **options):
    import mpiring

    out, lse = mpiring.ring_attention(c.q, c.k, c.v, c.comm, causal=True)
    dout = c.pick(c.do, options.pop("dout", c.do))
    return mpiring.ring_attention_backward(dout, c.q, c.k, c.v, out, lse, c.comm, causal=True, **options)


def _with_ring(c, call, **options):
    import mpiring

    with mpiring.Ring(c.comm, c.S, **options) as ring:
        return call(ring)


def _cache(c, **options):
    import mpiring

    cache = mpiring.KVCache(c.comm, H, D, dtype=np.float64, **options)
    cache.extend(c.K[..., :5, :], c.V[..., :5, :])
    return cache


def _verify_extend_commit(c):
    cache = _cache(c)
    cache.verify(c.Q[..., :2, :], c.K[..., 5:7, :], c.V[..., 5:7, :])
    cache.extend(c.K[..., 7:8, :], c.V[..., 7:8, :])
    cache.commit([0, 1])


def _verified(c, accepted):
    cache = _cache(c)
    cache.verify(c.Q[..., :2, :], c.K[..., 5:7, :], c.V[..., 5:7, :])
    cache.commit(accepted)


def _attend_many(c, n, odd_n):
    import mpiring

    caches = [_cache(c) for _ in range(n)]
    mine = caches[:c.pick(n, odd_n)]
    try:
        mpiring.attend_many(mine, [c.Q[..., :1, :]] * len(mine))
    finally:
        for cache in caches:
            cache.close()


def _decode(c, **options):
    import mpiring

    kv_pos = np.flatnonzero(np.arange(c.S) % c.P == c.rank)
    return mpiring.decode_attention(c.Q[..., :1, :], c.K[..., kv_pos, :], c.V[..., kv_pos, :], c.comm,
                                    positions=[c.S], kv_positions=kv_pos, **options)


def _helix(c, tp, chunks, q=None):
    import mpiring

    q = np.zeros((2, 2 * c.P, 1, D)) if q is None else q
    with mpiring.HelixGrid(c.comm, tp) as grid:
        kv = np.ones((2, 2 * c.P // grid.tp_size, 3, D))
        mpiring.helix_attention(q[:, :2 * c.P // grid.tp_size], kv, kv, grid, chunks=chunks)


def _distributed(c, backward=False, root=0, **options):
    import mpiring

    full = (c.Q, c.K, c.V) if c.rank == root else (None, None, None)
    if backward:
        dout = c.dO if options.pop("dout", None) is None else c.dO[..., :3]
        return mpiring.distributed_attention_backward(*full, dout if c.rank == root else None, c.comm, root=root,
                                                      **options)
    return mpiring.distributed_attention(*full, c.comm, root=root, **options)


def _torch(c, ring=None, sinks=None, grad=True, **options):
    import torch

    import mpiring.torch

    q, k, v = (torch.from_numpy(np.ascontiguousarray(a)).requires_grad_(grad) for a in (c.q, c.k, c.v))
    if ring is None:
        options["comm"] = c.comm
    out = mpiring.torch.ring_attention(q, k, v, ring, sinks=sinks, **options)
    if out.requires_grad:
        out.sum().backward()


def _sinks(c, odd_value):
    import torch

    return torch.tensor([0.5, c.pick(0.25, odd_value)], dtype=torch.float64, requires_grad=True)


def _context_parallel(c, **ring_options):
    import mpiring.hf

    with mpiring.hf.ContextParallel(c.comm, **ring_options) as cp:
        cp.ring(c.S, None, {"causal": True})


CONTENT = "function data by content (plans.content)"
# (entry point, what rank b passes or does, the words every rank's ValueError has, the case)
CASES = [
    ("ring_attention", "window=(2, 0)", "rank {b}: window (2, 0) differs from rank 0's (-1, -1)",
     lambda c: _ring(c, window=c.pick(None, (2, 0)))),
    ("ring_attention", "a mask closing over a 10,000-entry torch tensor, one element flipped",
     "rank {b}: mask differs from rank 0's: mask Function(_closure_mask.<locals>.flagged).fn: closure cell 'flags' "
     "(torch.Tensor bool (10000,)): first differing element 5177: rank 0 has False, rank {b} has True",
     lambda c: _ring(c, mask=_masks().function(_closure_mask(_flags(c, True))))),
    ("ring_attention", "a mask closing over a NumPy array inside a list, one element changed",
     "closure cell 'tables'[0] (numpy.ndarray int64 (10000,)): first differing element 4321: rank 0 has 4321, "
     "rank {b} has -4321",
     lambda c: _ring(c, mask=_masks().function(_listed([np.arange(10_000) * c.pick(1, np.where(
         np.arange(10_000) == 4321, -1, 1))])))),
    ("ring_attention", "a global array the mask reads, one element changed",
     "global 'GLOBAL_FLAGS' (numpy.ndarray bool (10000,)): first differing element 617: rank 0 has False, "
     "rank {b} has True", _global_case),
    ("ring_attention", "functools.partial of another function",
     "rank {b}: mask Function(functools.partial(keep_all, ...)) differs from rank 0's "
     "Function(functools.partial(keep_causal, ...))",
     lambda c: _ring(c, mask=_masks().function(functools.partial(c.pick(keep_causal, keep_all))))),
    ("ring_attention", "a callable object with another attribute",
     "mask Function(Near object).fn.width (int): rank 0 has 3, rank {b} has 4",
     lambda c: _ring(c, mask=_masks().function(Near(c.pick(3, 4))))),
    ("ring_attention", "a mask function with another default argument",
     "default 'width' (int): rank 0 has 3, rank {b} has 4",
     lambda c: _ring(c, mask=_masks().function(window_mask(c.pick(3, 4))))),
    ("ring_attention", "a bias closing over other slopes",
     "rank {b}: bias differs from rank 0's: bias: closure cell 'slopes' (numpy.ndarray float64 (2,)): "
     "first differing element 1: rank 0 has 0.25, rank {b} has 0.5",
     lambda c: _ring(c, bias=_bias_of(np.array([0.5, c.pick(0.25, 0.5)])))),
    ("ring_attention", "other sinks", "rank {b}: sinks [0.0, 2.0] differs from rank 0's [0.0, 1.0]",
     lambda c: _ring(c, sinks=np.array([0.0, c.pick(1.0, 2.0)]))),
    ("ring_attention", "q a list (its own checks fail)", "rank {b}: q must be a NumPy array, got list",
     lambda c: _ring(c) if not c.odd else __import__("mpiring").ring_attention(c.q.tolist(), c.k, c.v, c.comm)),
    ("ring_attention", "a bias raising at one pair inside the ring (auto)",
     "the bias function _pair_bias.<locals>.pair_bias fails on query positions", lambda c: _mid_ring_bias(c, "auto")),
    ("ring_attention", "a bias raising at one pair inside the ring (timeout=20)",
     "the bias function _pair_bias.<locals>.pair_bias fails on query positions", lambda c: _mid_ring_bias(c, 20)),
    ("ring_attention", "a bias giving NaN at one pair, check_finite=True",
     "the bias function _nan_bias.<locals>.nan_bias fails on query positions",
     lambda c: _ring(c, causal=True, bias=_nan_bias((c.S - 2, 1)), check_finite=True)),
    ("ring_attention_backward", "grad_wire_dtype='float64'",
     "rank {b}: grad_wire_dtype 'float64' differs from rank 0's", lambda c: _backward(
         c, grad_wire_dtype=c.pick(None, "float64"))),
    ("ring_attention_backward", "dout of another head dim", "rank {b}: dout must have shape",
     lambda c: _backward(c, dout=c.do[..., :3])),
    ("Ring", "a mask: functools.partial of another function",
     "rank {b}: mask Function(functools.partial(keep_all, ...)) differs from rank 0's "
     "Function(functools.partial(keep_causal, ...))",
     lambda c: _with_ring(c, lambda r: None, mask=_masks().function(functools.partial(c.pick(keep_causal,
                                                                                             keep_all))))),
    ("Ring", "seq_axis='sbd'", "rank {b}: seq_axis 'sbd' differs from rank 0's -2",
     lambda c: _with_ring(c, lambda r: None, seq_axis=c.pick(-2, "sbd"))),
    ("Ring", "seq_axis='bad' (its own checks fail)", "rank {b}: seq_axis must be an int or a string naming every axis",
     lambda c: _with_ring(c, lambda r: None, seq_axis=c.pick(-2, "bad"))),
    ("Ring.forward", "float32 arrays", "rank {b}: dtype 'float32' differs from rank 0's 'float64'",
     lambda c: _with_ring(c, lambda r: r.forward(*(a.astype(c.pick(np.float64, np.float32))
                                                   for a in (c.q, c.k, c.v))))),
    ("Ring.forward", "scale=0.3 given to the call", "rank {b}: scale=0.3 given to this call differs from the Ring's",
     lambda c: _with_ring(c, lambda r: r.forward(c.q, c.k, c.v, **({"scale": 0.3} if c.odd else {})))),
    ("Ring.forward", "a bias raising at one pair inside the ring",
     "the bias function _pair_bias.<locals>.pair_bias fails on query positions",
     lambda c: _with_ring(c, lambda r: r.forward(c.q, c.k, c.v), causal=True, bias=_pair_bias((c.S - 2, 1)))),
    ("Ring.backward", "dlse of another shape", "rank {b}: dlse must be an array shaped as lse",
     lambda c: _with_ring(c, lambda r: r.backward(c.do, c.q, c.k, c.v, *r.forward(c.q, c.k, c.v),
                                                  dlse=c.pick(None, np.zeros(3))))),
    ("decode_attention", "a bias whose data depends on the rank",
     "rank {b}: bias differs from rank 0's: bias: closure cell 'slopes'",
     lambda c: _decode(c, bias=_bias_of(np.array([0.5, c.pick(0.25, 0.5)])))),
    ("decode_attention", "a mask raising on its own cache",
     "rank {b}: the mask Function(_raising.<locals>.raises_on_odd) fails on query positions {S} and key positions",
     lambda c: _decode(c, mask=_masks().function(_raising(c)))),
    ("decode_many", "1 sequence, 2 elsewhere", "rank {b}: sequences 1 differs from rank 0's 2",
     lambda c: __import__("mpiring").decode_many([c.Q[..., :1, :]] * c.pick(2, 1), [c.k] * c.pick(2, 1),
                                                 [c.v] * c.pick(2, 1), c.comm)),
    ("decode_many", "no lists (its own checks fail)", "rank {b}: qs, ks, vs must be lists",
     lambda c: __import__("mpiring").decode_many(c.pick([c.Q[..., :1, :]], c.Q), [c.k], [c.v], c.comm)),
    ("KVCache", "quantize='float16'", "rank {b}: quantize 'float16' differs from rank 0's None",
     lambda c: _cache(c, quantize=c.pick(None, "float16"))),
    ("KVCache", "kv_heads=0 (its own checks fail)", "rank {b}: kv_heads must be a positive integer, got 0",
     lambda c: __import__("mpiring").KVCache(c.comm, c.pick(H, 0), D)),
    ("KVCache.prefill", "k with one head (its own checks fail)", "rank {b}: k must have shape (..., 2, tokens, 8)",
     lambda c: __import__("mpiring").KVCache(c.comm, H, D, dtype=np.float64).prefill(
         c.q, c.pick(c.k, c.k[:, :1]), c.v)),
    ("KVCache.adopt", "positions of another length", "rank {b}: positions must be a 1-D integer array",
     lambda c: __import__("mpiring").KVCache(c.comm, H, D, dtype=np.float64).adopt(c.k, c.v, c.pick(c.i, c.i[:1]))),
    ("KVCache.extend", "other new tokens", "rank {b}: new k differs from rank 0's: new k (numpy.ndarray float64",
     lambda c: _cache(c).extend(c.K[..., 5:6, :] + c.odd, c.V[..., 5:6, :])),
    ("KVCache.attend", "other queries", "rank {b}: q differs from rank 0's: q (numpy.ndarray float64",
     lambda c: _cache(c).attend(c.Q[..., :1, :] + c.odd)),
    ("KVCache.attend", "a global array the mask reads, one element changed",
     "global 'GLOBAL_FLAGS' (numpy.ndarray bool (10000,)): first differing element 617", lambda c: _attend_global(c)),
    ("KVCache.attend", "float32 q (its own checks fail)", "rank {b}: q must be a float64 array, as the cache",
     lambda c: _cache(c).attend(c.Q[..., :1, :].astype(c.pick(np.float64, np.float32)))),
    ("KVCache.verify", "other parents", "rank {b}: parents [-1, -1] differs from rank 0's [-1, 0]",
     lambda c: _cache(c).verify(c.Q[..., :2, :], c.K[..., 5:7, :], c.V[..., 5:7, :], c.pick([-1, 0], [-1, -1]))),
    ("KVCache.verify", "a parent after its child (its own checks fail)", "rank {b}: parents[0] = 1",
     lambda c: _cache(c).verify(c.Q[..., :2, :], c.K[..., 5:7, :], c.V[..., 5:7, :], c.pick([-1, 0], [1, 0]))),
    ("KVCache.commit", "other accepted drafts", "rank {b}: accepted [0] differs from rank 0's [0, 1]",
     lambda c: _verified(c, c.pick([0, 1], [0]))),
    ("KVCache.commit", "accepted [0.9, 1.2] (not indices)", "rank {b}: accepted must be integer indices",
     lambda c: _verified(c, c.pick([0, 1], [0.9, 1.2]))),
    ("KVCache.commit", "an extend between verify and commit (every rank)", "commit follows a verify of drafts after 5",
     _verify_extend_commit),
    ("attend_many", "1 sequence, 2 elsewhere", "rank {b}: sequences 1 differs from rank 0's 2",
     lambda c: _attend_many(c, 2, 1)),
    ("attend_many", "no caches at all (auto)", "rank {b}: attend_many needs at least one cache",
     lambda c: _attend_many(c, 1, 0)),
    ("HelixGrid", "tp={P}, 1 elsewhere", "rank {b}: tp {P} differs from rank 0's 1",
     lambda c: _helix(c, c.pick(1, c.P), 1)),
    ("helix_attention", "chunks=2", "chunks 2 differs from rank 0's 1", lambda c: _helix(c, 1, c.pick(1, 2))),
    ("helix_attention", "3-D q (its own checks fail)", "q must be (batch, heads, tokens, dim)",
     lambda c: _helix(c, 1, 1, c.pick(None, np.zeros((2, 2 * c.P, D))))),
    ("distributed_attention", "causal=True", "rank {b}: causal True differs from rank 0's False",
     lambda c: _distributed(c, causal=c.odd)),
    ("distributed_attention", "root={b}, with no Q (its own checks fail)",
     "root rank {b}: Q must be a NumPy array on the root rank, got NoneType",
     lambda c: __import__("mpiring").distributed_attention(None, c.K, c.V, c.comm, root=c.b)),
    ("distributed_attention_backward", "window=(1, 0)", "rank {b}: window (1, 0) differs from rank 0's (-1, -1)",
     lambda c: _distributed(c, True, window=c.pick(None, (1, 0)))),
    ("distributed_attention_backward", "root={b}, dOut of another head dim", "root rank {b}: dOut must be a float64 "
     "array of shape", lambda c: _distributed(c, True, root=c.b, dout=True)),
    ("mpiring.torch.ring_attention", "other trainable sinks",
     "rank {b}: sinks tensor differs from rank 0's: sinks tensor (torch.Tensor float64 (2,)): first differing "
     "element 1: rank 0 has 0.25, rank {b} has 0.75", lambda c: _torch(c, sinks=_sinks(c, 0.75))),
    ("mpiring.torch.ring_attention", "tensors without requires_grad",
     "rank {b}: requires_grad False differs from rank 0's True", lambda c: _torch(c, grad=not c.odd)),
    ("mpiring.torch.ring_attention", "NaN sinks (its own checks fail)", "rank {b}: sinks must be finite logits",
     lambda c: _torch(c, sinks=_sinks(c, float("nan")))),
    ("mpiring.torch.ring_attention with a Ring", "causal=True given to the call",
     "rank {b}: causal=True given to this call differs from the Ring's False",
     lambda c: _with_ring(c, lambda r: _torch(c, r, **({"causal": True} if c.odd else {})), seq_axis=-2)),
    ("mpiring.hf.ContextParallel", "a ring option: a mask partial of another function",
     "rank {b}: mask Function(functools.partial(keep_all, ...)) differs from rank 0's "
     "Function(functools.partial(keep_causal, ...))",
     lambda c: _context_parallel(c, mask=_masks().function(functools.partial(c.pick(keep_causal, keep_all))))),
    ("mpiring.hf.ContextParallel", "seq_axis=-3 (every rank, when built)",
     "seq_axis= is no ring option of ContextParallel", lambda c: _context_parallel(c, seq_axis=-3)),
    ("ring_attention", "masks.documents([0, 10, 20]) on a longer sequence (every rank)",
     "mask Documents([0, 10, 20]): cu_seqlens must start at 0 and end at the total length",
     lambda c: _ring(c, mask=_masks().documents([0, 10, 20]))),
    ("ring_attention", "masks.padding([5, 5, 5]) for a batch of 1 (every rank)",
     "Padding([5, 5, 5]) gives lengths of shape (3,), one per batch entry, but q's batch shape is (1,)",
     lambda c: _ring(c, mask=_masks().padding([5, 5, 5]))),
    ("ring_attention", "seq_axis='bsd' on 4-D arrays (every rank)",
     "seq_axis='bsd' names 3 axes, but q has 4", lambda c: _ring(c, seq_axis="bsd")),
]


def _raising(c):
    odd_keys = np.flatnonzero(np.arange(c.S) % c.P == c.b)

    def raises_on_odd(q, k):  # fails on rank b's last cache position only
        if np.any(k == odd_keys[-1]):
            raise LookupError("no such key")
        return k <= q
    return raises_on_odd


def _attend_global(c):
    GLOBAL_FLAGS[617] = c.odd
    try:
        _cache(c).attend(c.Q[..., :1, :], mask=_masks().function(global_mask), positions=[5])
    finally:
        GLOBAL_FLAGS[617] = False


def runnable():
    """The cases this machine can run: those of torch tensors, mpiring.torch and mpiring.hf need torch (and hf
    transformers), which run/test without --with-torch does not install."""
    def can(entry, what):
        needs = (["torch"] if "torch" in entry + what or entry.startswith("mpiring.hf") else []) + (
            ["transformers"] if entry.startswith("mpiring.hf") else [])
        return all(importlib.util.find_spec(name) is not None for name in needs)
    return [i for i, (entry, what, _, _) in enumerate(CASES) if can(entry, what)]


def expected(index, P):
    return CASES[index][2].format(b=P - 1, P=P, S=4 * P)


def table():
    """The markdown table of docs/reliability.md §1b: every case, its entry point, what differs and the words."""
    rows = ["| entry point | rank b passes or does | every rank raises ValueError with |", "|---|---|---|"]
    for entry, what, words, _ in CASES:
        shown = {"{b}": "b", "{P}": "P", "{S}": "S"}
        rows.append(f"| `{entry}` | {functools.reduce(lambda t, kv: t.replace(*kv), shown.items(), what)} | "
                    f"`{functools.reduce(lambda t, kv: t.replace(*kv), shown.items(), words)}` |")
    return "\n".join(rows)


def run_case(c, index):
    """``(seconds, outcome)`` of this rank in case ``index``, from a common start (a barrier)."""
    c.comm.Barrier()
    start = time.perf_counter()
    try:
        CASES[index][3](c)
        outcome = "returned"
    except ValueError as exc:  # the same class on every rank: another rank's announced error is one too
        outcome = f"ValueError: {exc}"
    except Exception as exc:  # noqa: BLE001 -- what each rank gets is the point
        outcome = f"{type(exc).__name__}: {exc}"
    return time.perf_counter() - start, outcome


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", type=int, default=None, help="case numbers (default: all)")
    parser.add_argument("--table", action="store_true", help="print the docs' table and stop")
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    from mpi4py import MPI

    from mpiring.plans.checks import backend_problem

    comm = MPI.COMM_WORLD
    problem = backend_problem()  # the kernel backend loaded before the first case's clock starts
    if problem:
        raise SystemExit(problem)
    cases = runnable() if args.cases is None else args.cases
    if importlib.util.find_spec("transformers") is not None:
        import mpiring.hf  # torch's and transformers' imports (seconds under load) before it too

        mpiring.hf.register()
    c = Case(comm)
    for index in cases:
        seconds, outcome = run_case(c, index)
        said = comm.gather((seconds, outcome), root=0)  # blocking: every rank has returned by now
        if c.rank == 0:
            print(json.dumps({"case": index, "seconds": [round(s, 2) for s, _ in said],
                              "outcomes": [o for _, o in said]}), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
