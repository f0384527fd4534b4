"""A reusable ring for training loops: options agreed, plan built, communicators duplicated once.

    with mpiring.Ring(comm, seq_len, causal=True, layout="zigzag") as ring:
        for batch in batches:
            out, lse = ring.forward(q, k, v)
            dq, dk, dv = ring.backward(dout, q, k, v, out, lse)

A call on the handle checks its arrays on every rank and agrees with one
small all-reduce (which is also the common start); the options cannot be
retyped, so a backward cannot differ from its forward. ``ring_attention`` and
``ring_attention_backward`` are thin wrappers: each call agrees on everything
with one all-gather, makes a one-call handle (a communicator duplicate) and
frees it. The lse a forward returns remembers the options that made it
(``Lse.made_by``): a backward given other options raises instead of returning
wrong gradients.
"""

import contextlib

import numpy as np

from .core.block import GRAD_DTYPE
from .core.kernels import default_scale
from .core.precision import Precision
from .core.scores import FunctionFailed, Score
from .core.threads import limited, threads_for, threads_problem
from .core.tiles import release_workspace
from .lse import Lse, lse_problem, mismatch
from .mpi.agree import Hosts, call_spec, check_call, check_comm, contiguous, moved_arrays, opening, setup, setup_ring
from .mpi.axes import axis_problem, seq_index
from .mpi.checks import (
    agreement_timeout,
    call_values,
    describe,
    dlse_problem,
    grad_problem,
    length_problem,
    local_problem,
    logit_problem,
    pairs_problem,
    peaks,
    resolve_timeout,
)
from .mpi.record import Record
from .mpi.waits import Announced, CommTimeout, Watch, exclusive, watching
from .options import SCORES, options_problem
from .parallel.strategies import private_rings, rotation, run_backward, run_forward, scored_forward, sink_gradients
from .plans.layouts import LAYOUTS, shard, take_rows
from .plans.spec import Spec, spec_problem

__all__ = ["Ring", "Lse", "Spec", "ring_attention", "ring_attention_backward"]


class Ring:
    """Context-parallel attention over ``comm``, agreed once and called many times.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD); one rank = one device.
        seq_len: tokens of the whole sequence (every rank holds its shard of it).
        causal, scale, layout, mode, window, cu_seqlens, timeout, check_finite,
            expected_size: as ``ring_attention``; the same on every rank.
        seq_axis: the sequence axis of q, k, v, out and dout (-2: ``(..., S, D)``;
            -3: flash-attn's ``(B, S, H, D)``), or the axes named, "bshd" or "bhsd"
            (``mpiring.mpi.axes``). lse is always ``(..., H, S)``.
        threads: BLAS threads per rank inside every call: "auto" (the node's
            cores shared among its ranks; ``mpiring.core.threads``), an int, or None
            (leave BLAS alone).
        spec: a ``Spec`` (``mpiring.plans.spec``) saying all of the above
            that it holds (the problem and the strategy); options passed beside
            it must equal its own.

    Construction is collective (one all-gather, and communicator duplicates
    freed by ``close()`` or on leaving a ``with`` block); so is every call.
    Bad arguments raise the same ValueError on every rank and leave the handle
    usable; a call that fails in the ring (CommTimeout, an interrupt) leaves it
    closed.
    """

    def __init__(self, comm=None, seq_len=None, *, causal: bool = False, scale: float | None = None,
                 layout: str = "contiguous", mode: str = "ring", window=None, cu_seqlens=None,
                 timeout: float | str | None = "auto", seq_axis: int = -2, threads="auto",
                 wire_dtype: str | None = None, grad_wire_dtype: str | None = None, accumulate: str = "float64",
                 positions=None, kv_positions=None, causal_block: int | None = None, node_size: int | None = None,
                 ulysses_size: int | None = None, rotate: str = "kv", check_finite: bool = False,
                 expected_size: int | None = None, mask=None, softcap: float | None = None, bias=None, sinks=None,
                 dropout: float = 0.0, seed: int = 0, return_max_logit: bool = False, spec: Spec | None = None):
        comm = check_comm(comm)
        spec, problem = spec_problem(dict(
            seq_len=seq_len, layout=layout, mode=mode, causal=causal, scale=scale, window=window,
            cu_seqlens=cu_seqlens, wire_dtype=wire_dtype, grad_wire_dtype=grad_wire_dtype, accumulate=accumulate,
            positions=positions, kv_positions=kv_positions, causal_block=causal_block, node_size=node_size,
            ulysses_size=ulysses_size, rotate=rotate, mask=mask, softcap=softcap, bias=bias, sinks=sinks,
            dropout=dropout, seed=seed, return_max_logit=return_max_logit), spec)
        problem = axis_problem({}, seq_axis) or threads_problem(threads) or problem
        plan, spec, hosts = setup_ring(comm, spec, timeout, expected_size, problem,
                                       values=dict(seq_axis=seq_axis, threads=threads, check_finite=check_finite))
        self._start(comm, plan, spec, timeout, hosts, seq_axis, threads, check_finite, backward=True)

    @classmethod
    def _agreed(cls, comm, plan, spec, timeout, hosts, seq_axis, threads, backward, check_finite=False):
        """A handle for one call whose arguments were agreed already (``agree.setup``)."""
        ring = cls.__new__(cls)
        ring._start(comm, plan, spec, timeout, hosts, seq_axis, threads, check_finite, backward)
        return ring

    def _start(self, comm, plan, spec, timeout, hosts, seq_axis, threads, check_finite, backward):
        self.plan, self.spec, self.check_finite = plan, spec, check_finite
        self.seq_axis = seq_axis if isinstance(seq_axis, str) else int(seq_axis)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.threads = threads_for(threads, hosts, self.rank)
        self._timeout, self._failed, self._rings = timeout, None, []
        # private duplicates: K/V; and what the strategy's backward needs (the ring modes: dK/dV onward and home)
        self.plan, self._rings = private_rings(comm, plan, spec.node_size, agreement_timeout(timeout), backward)
        self._watch = Watch(self._rings[0].comm, getattr(hosts, "token", 0))  # the others' failure notices

    # ------------------------------------------------------------------ the handle's life

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Free the private communicators (collective only in that every rank should close its handle)."""
        self._watch.close()
        for ring in self._rings:
            ring.free()  # pending transfers, after a failure, are abandoned, never cancelled
        self._rings = []
        self._failed = self._failed or "it was closed"

    # ------------------------------------------------------------------ the options, read-only

    @property
    def options(self):
        """The options a call may repeat (``mpiring.options.CALL_OPTIONS``), as this Ring holds them."""
        spec = self.spec
        return {"scale": self.scale, "causal": spec.causal, "layout": self.layout, "mode": spec.mode,
                "window": tuple(spec.window), "cu_seqlens": spec.cu_seqlens, "causal_block": spec.causal_block,
                "timeout": self._timeout, "seq_axis": self.seq_axis, "rotate": spec.rotate,
                "ulysses_size": spec.ulysses_size, "check_finite": self.check_finite, **spec.precision,
                **{name: getattr(spec, name) for name in SCORES}}

    scale = property(lambda self: self.spec.scale,
                     doc="The softmax scale given to the Ring, a float; None: each call's 1/sqrt(head dim of q).")
    causal = property(lambda self: self.spec.causal)
    layout = property(lambda self: self.plan.layout, doc="The layout, or 'positions' when positions were given.")
    mode = property(lambda self: self.spec.mode)
    window = property(lambda self: tuple(self.spec.window), doc="(left, right), -1 unbounded.")
    cu_seqlens = property(lambda self: self.spec.cu_seqlens)
    seq_len = property(lambda self: self.plan.seq_len)
    timeout = property(lambda self: self._timeout)

    @property
    def positions(self):
        """The global positions of this rank's query rows (for RoPE or position embeddings), in its row order."""
        return self.plan.in_caller_order(self.rank, self.plan.shards[self.rank], axis=-1)

    def shard(self, x, axis=None):
        """This rank's part of a full array ``x``, the sequence on ``axis`` (default: this handle's seq_axis).

        A view for the contiguous and striped layouts, a copy otherwise (``mpiring.shard``).
        """
        axis = seq_index(self.seq_axis if axis is None else axis, np.ndim(x))
        if self.plan.layout in LAYOUTS:  # the layout's tokens, in every mode
            return shard(x, self.size, self.rank, self.plan.layout, axis)
        return np.take(x, self.positions, axis=0 if np.ndim(x) == 1 else axis)

    @contextlib.contextmanager
    def _call(self):
        if self._failed:
            raise RuntimeError(f"this Ring cannot be used any more: {self._failed}")
        with exclusive(self._rings[0].comm), limited(self.threads), watching(self._watch):
            try:
                yield
            except Announced as exc:  # another rank failed in this call or the last: this handle cannot go on
                self._fail(exc)
                raise

    @contextlib.contextmanager
    def _running(self):
        """Inside the ring: a failure here leaves transfers behind, so the handle closes, and the others hear of
        it at their next wait (``Watch.announce``): a user's function that failed as the same ValueError on every
        rank, any other failure as CommTimeout naming it."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, FunctionFailed):
                text = f"rank {self.rank}: {exc}"
                self._watch.announce(text, value=True)
                self._fail(exc)
                raise ValueError(text) from exc
            if not isinstance(exc, (CommTimeout, Announced, KeyboardInterrupt)):
                self._watch.announce(f"rank {self.rank} failed in the call: {type(exc).__name__}: {exc}")
            self._fail(exc)
            raise

    def _fail(self, exc):
        self._watch.close()
        self._failed = f"a call failed in the ring ({type(exc).__name__}: {exc})"
        for ring in self._rings:
            ring.free()
        self._rings = []
        release_workspace()  # an abandoned receive may still land in a kept buffer: none is used again

    # ------------------------------------------------------------------ calls

    def forward(self, q, k, v, *, record: Record | None = None, problem: str | None = None, shared=None, **options):
        """This rank's ``(out, lse)``: out shaped as q with v's head dim, lse ``(..., Hq, n)`` (an ``Lse``).

        ``options``: any of the Ring's own (``scale=``, ``causal=``, ...; ``mpiring.options``), as a
        model passes them at every call: equal to the Ring's or refused. ``problem``: this rank's
        own problem with the call, found by the caller (an adapter): every rank raises it as bad input;
        ``shared``: what else every rank must pass alike (an adapter's: ``{name: checks.Shown}``).
        """
        with self._call():
            (q, k, v), _, scale, timeout = self._agree_call({"q": q, "k": k, "v": v}, None, None, options, problem,
                                                            shared)
            return self._forward(q, k, v, scale, record, timeout)

    def backward(self, dout, q, k, v, out, lse, *, dlse=None, record: Record | None = None, problem=None, **options):
        """This rank's ``(dq, dk, dv)`` (shapes and dtypes of q, k, v) from the forward's out and lse.

        ``dlse``: the loss's gradient with respect to lse, when lse is used
        too (as by a PyTorch graph); it enters as ``delta - dlse``. ``options``, ``problem``: as ``forward``.
        """
        with self._call():
            arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out}
            moved, lses, scale, timeout = self._agree_call(arrays, lse, dlse, options, problem)
            return self._backward(moved, lses, scale, record, timeout)

    def _agree_call(self, tensors, lse, dlse, options, problem, shared=None):
        """Move the sequence to axis -2, check on this rank, agree on every rank; contiguous arrays, the scale and the
        timeout of every wait."""
        moved, lses, values, peak, timeout = [], [], None, [0.0, 0.0], None
        same_rows = self.spec.kv_positions is None
        try:
            tokens = {"q": len(self.plan.shards[self.rank]), "k": len(self.plan.kv_shards[self.rank])}
            problem = problem or axis_problem(tensors, self.seq_axis, tokens, same_rows, lse)
            if problem is None:
                moved = [np.moveaxis(a, seq_index(self.seq_axis, a.ndim), -2) for a in tensors.values()]
                names = dict(zip(tensors, moved))
                q, k, v = names["q"], names["k"], names["v"]
                problem = (local_problem(q, k, v, None, self.check_finite, same_rows)
                           or options_problem(options, self.options, q)
                           or length_problem(self.plan, self.rank, q, k) or self.spec.heads_problem(q, k, self.size)
                           or self.spec.scores_problem(q))
                if problem is None and lse is not None:
                    problem = (grad_problem(names["dout"], q, k, v, names["out"], lse)
                               or dlse_problem(dlse, lse)
                               or mismatch(lse, self.spec.made_by(self.size, self._resolved_scale(q),
                                                                  self.plan.seq_len)))
            if problem is None:  # may fail alone (MemoryError): agreed below
                moved, lses = contiguous(dict(zip(tensors, moved)), [a for a in (lse, dlse) if a is not None])
                moved, lses = self._sorted(list(tensors), moved, lses)
                values = dict(call_values(names), **(shared or {}))
                peak = peaks(names["q"], names["k"])
                timeout, problem = self._before_ring(names["q"], 1.0 if lse is None else 2.5)
        except Exception as exc:  # reported collectively, never raised alone
            problem = describe(exc)
        try:
            highest = check_call(self._rings[0].comm, problem, values, peak, self._timeout)
        except CommTimeout as exc:  # its communicator keeps a pending all-reduce: the handle cannot serve again
            self._fail(exc)
            raise
        q = moved[list(tensors).index("q")]
        scale = self._resolved_scale(q)
        message = logit_problem(scale, q.shape[-1], highest[0], highest[1], q.dtype)
        if message:
            raise ValueError(message)
        return moved, lses, scale, timeout

    def _resolved_scale(self, q):
        return default_scale(q.shape[-1]) if self.spec.scale is None else self.spec.scale

    def _sorted(self, names, arrays, lses):
        """The rows in position order, the order the ring works in (``Plan.in_caller_order`` undoes it)."""
        rows, kv_rows = self.plan.orders[self.rank], self.plan.kv_orders[self.rank]
        arrays = [take_rows(a, kv_rows if name in ("k", "v") else rows) for name, a in zip(names, arrays)]
        return arrays, [take_rows(a, rows, axis=-1) for a in lses]

    def _timeout_for(self, q, factor=1.0):
        return resolve_timeout(self._timeout, self.plan, q.size // (q.shape[-2] * q.shape[-1]), q.shape[-1], factor)

    def _before_ring(self, q, factor):
        """``(timeout, problem)``: the timeout of every wait, and this rank's problem with its own pairs
        (``checks.pairs_problem``: a user's function that fails on them is found before any data moves)."""
        try:
            timeout = self._timeout_for(q, factor)  # "auto": every rank's pairs counted, the same on every rank
        except FunctionFailed as exc:
            return agreement_timeout(self._timeout), str(exc)
        return timeout, pairs_problem(self.plan, self.spec, self.rank, q.shape[-3] if q.ndim > 2 else 1,
                                      self.check_finite)

    def _opening(self, q, factor, timeout):
        """The common start of a call whose arguments were agreed by ``setup`` (a handle's all-reduce is one): one
        all-reduce of whether a rank found a problem with its own pairs (``_before_ring``); a second round names
        it. Returns the timeout of every wait."""
        if timeout is not None:  # a handle's call: agreed already
            return timeout
        timeout, problem = self._before_ring(q, factor)
        opening(self._rings[0].comm, problem, timeout)
        return timeout

    def _forward(self, q, k, v, scale, record, timeout=None):
        """The ring's forward on agreed arrays; ``timeout`` None: a one-call handle, which starts with ``_opening``."""
        timeout = self._opening(q, 1.0, timeout)
        rec = Record(self.rank) if record is None else record
        score = Score.of(self.spec, scale, q, finite=self.check_finite)
        with self._running():
            out, lse = run_forward(q, k, v, self.plan, self._rings[0], score, rec, timeout,
                                   Precision.of(q.dtype, self.spec.precision),
                                   rotation(self.spec.rotate, self.plan, q, k, v, self.spec.wire_dtype))
            out, lse, top = scored_forward(self.spec, score, out, lse, self._rings[0].comm, timeout)
        out, lse = self.plan.in_caller_order(self.rank, out), self.plan.in_caller_order(self.rank, lse, axis=-1)
        lse = lse.view(Lse)
        lse.made_by = self.spec.made_by(self.size, scale, self.plan.seq_len)
        out = np.moveaxis(out, -2, seq_index(self.seq_axis, out.ndim))
        return (out, lse) if top is None else (out, lse, top[0] if q.ndim == 2 else top)

    def _backward(self, moved, lses, scale, record, timeout=None):
        dout, q, k, v, out = moved
        pr = Precision.of(k.dtype, self.spec.precision)
        delta = np.einsum("...d,...d->...", dout, out, dtype=GRAD_DTYPE)  # no float64 copies of dout and out
        if len(lses) > 1:  # d lse / d score = p: the dlse term joins delta (ds = p * (dp - delta + dlse))
            delta -= lses[1]
        timeout = self._opening(q, 2.5, timeout)
        rec = Record(self.rank) if record is None else record
        with self._running():
            grads = run_backward((dout, q, k, v, out, lses[0], delta.astype(q.dtype)), self.plan, self._rings,
                                 Score.of(self.spec, scale, finite=self.check_finite), rec, timeout, pr)
            dsinks = sink_gradients(self.spec, lses[0], delta, self._rings[0].comm, timeout)
        grads = [self.plan.in_caller_order(self.rank, g.astype(pr.input, copy=False), kv=i > 0)
                 for i, g in enumerate(grads)]
        grads = tuple(np.moveaxis(g, -2, seq_index(self.seq_axis, g.ndim)) for g in grads)
        return grads if dsinks is None else grads + (dsinks,)


# ---------------------------------------------------------------------- the plain functions


def ring_attention(
    q: np.ndarray,  # (..., Hq, n, D): this rank's queries (n = its tokens under ``layout``)
    k: np.ndarray,  # (..., Hk, n, D), Hq a multiple of Hk
    v: np.ndarray,  # (..., Hk, n, Dv)
    comm=None, *, causal: bool = False, scale: float | None = None, layout: str = "contiguous",
    mode: str = "ring", window: tuple[int, int] | None = None, cu_seqlens=None,
    timeout: float | str | None = "auto", record: Record | None = None, check_finite: bool = False,
    expected_size: int | None = None, seq_axis: int = -2, threads="auto", wire_dtype: str | None = None,
    accumulate: str = "float64", positions=None, kv_positions=None, causal_block: int | None = None,
    node_size: int | None = None, ulysses_size: int | None = None, rotate: str = "kv", mask=None,
    softcap: float | None = None, bias=None, sinks=None, dropout: float = 0.0, seed: int = 0,
    return_max_logit: bool = False, spec: Spec | None = None, problem: str | None = None, shared=None,
) -> tuple[np.ndarray, np.ndarray]:  # out (..., Hq, n, Dv), lse (..., Hq, n)
    """Attention of this rank's queries against the whole distributed sequence.

    Every rank passes its local shard ``(..., seq_local, dim)`` of q, k, v (the
    ``layout`` says which tokens it holds) and gets its ``(out, lse)`` back:
    out ``(..., Hq, seq_local, dim_v)`` and the log-sum-exp ``(..., Hq, seq_local)``.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD); one rank = one device.
        causal: token t attends only to tokens <= t.
        scale: softmax scale, default 1/sqrt(dim).
        layout: "contiguous", "zigzag" or "striped" (see ``mpiring.plans.layouts``).
        mode: "ring", "bidirectional" or "allgather" (see ``mpiring.plans.plan``); "ulysses": heads move by
            all-to-all (``mpiring.plans.heads``); "double_ring": an inner ring per node, an outer ring across
            nodes (``mpiring.plans.hierarchy``).
        window: sliding window ``(left, right)`` as in flash-attn; -1 is unbounded.
        cu_seqlens: packed documents ``[0, end_0, end_1, ..., seq_len]`` (global positions).
        positions: global positions of this rank's q (and k, v) rows, any
            order and any number (at least one); the ranks' together hold every
            position of the sequence once. Replaces ``layout`` (see ``mpiring.balance``).
        kv_positions: positions of this rank's k, v rows when they are not q's
            (queries against a longer K/V: every rank's together hold every key
            position once; q positions are then distinct positions among them).
        causal_block: with ``causal``, key j is visible to query i iff
            j // causal_block <= i // causal_block (frame-causal video masks).
        mask, softcap, bias, sinks, dropout, seed, return_max_logit: any mask (pieces of ``mpiring.masks``
            combined with ``&`` and ``|``) and score modifiers (docs/masks.md); with ``sinks`` the backward
            returns ``(dq, dk, dv, dsinks)``, with ``return_max_logit`` the forward ``(out, lse, max_logit)``.
        node_size: ranks per node for the double ring; None: as MPI places them (``COMM_TYPE_SHARED``).
        ulysses_size: u: Ulysses inside groups of u consecutive ranks, the ring ``mode`` across the P/u
            groups (``mpiring.plans.heads.HybridPlan``); every rank holds the tokens ``layout`` gives it, as in
            every mode.
        rotate: what travels the ring: "kv" (K/V blocks), "q" (query blocks; K/V
            stay and the partial results go home, ``mpiring.parallel.passq``; mode "ring"
            only), or "auto": whichever sends fewer bytes under the plan
            (``passq.plan_bytes``); the choice is in ``record.rotate``.
        timeout: seconds a rank may wait for the others (each transfer, a final
            check) before raising ``CommTimeout``; an error or stall on one rank
            then raises on every rank still alive: the failed rank its own error
            at once, the others CommTimeout within 2.5 x timeout. "auto" (the
            default): 60 s for ranks to arrive, then 60 s plus the busiest rank's
            FLOPs at 1e8 FLOP/s for every wait (``agree.resolve_timeout``). None
            waits forever. Must be the same on every rank and exceed the
            longest compute step.
        record: a ``Record`` to fill with tasks, events and traffic counters.
        check_finite: also reject NaN/Inf in q, k, v (one extra pass over them), and NaN/+Inf values from a
            ``bias`` (on every tile: a failure inside the ring is every rank's ValueError).
        expected_size: raise unless the communicator has this many ranks.
        seq_axis: the sequence axis of q, k, v and out (-3 for ``(B, S, H, D)``).
        threads: BLAS threads per rank during the call ("auto": the node's
            cores shared among its ranks; ``mpiring.core.threads``), or None.
        wire_dtype: "float16", "bfloat16", "int8", "float8_e4m3" or "float8_e5m2": K/V travel coded so
            (int8, FP8: with a float32 scale per token and head), default the input dtype
            (``mpiring.core.precision``); in
            every mode (Ulysses' and the grid's all-to-alls too); with ``rotate="q"`` the query
            blocks travel coded instead. What a rank holds itself is never coded.
        accumulate: "float64" (default), "float32" or "input": the running (out, lse)'s dtype.
        spec: a ``Spec`` (``mpiring.plans.spec``) holding the problem and strategy options above instead;
            options passed beside it must equal its own.
        problem: this rank's own problem with the call, found by its caller (an adapter): every rank
            raises it, as bad input; shared: what else every rank must pass alike (``{name: checks.Shown}``).

    float16 and bfloat16 inputs compute in float32: out comes back in the input
    dtype, lse in float32. Bad arguments on any rank raise the same ``ValueError`` on every rank,
    before any transfer (see docs/reliability.md). Each call agrees and
    duplicates the communicator anew; ``mpiring.Ring`` does that once.
    """
    comm = check_comm(comm)
    with exclusive(comm):  # one call per communicator at a time (threads: one Dup each)
        first = problem  # the caller's: before any other
        spec, problem, same_rows = call_spec(
            spec, layout=layout, mode=mode, causal=causal, scale=scale, window=window, cu_seqlens=cu_seqlens,
            wire_dtype=wire_dtype, accumulate=accumulate, positions=positions, kv_positions=kv_positions,
            causal_block=causal_block, node_size=node_size, ulysses_size=ulysses_size, rotate=rotate, mask=mask,
            softcap=softcap, bias=bias, sinks=sinks, dropout=dropout, seed=seed, return_max_logit=return_max_logit)
        moved, moved_problem = moved_arrays({"q": q, "k": k, "v": v}, seq_axis, threads, same_rows)
        problem = moved_problem or problem or spec.heads_problem(moved[0], moved[1], comm.Get_size()) \
            or spec.scores_problem(moved[0])
        hosts = Hosts()
        plan, spec, scale, (q, k, v) = setup(*moved, comm, spec, check_finite, expected_size, timeout,
                                             prepare=lambda: [np.ascontiguousarray(a) for a in moved],
                                             problem=problem, rows="qkk", hosts=hosts, same_rows=same_rows,
                                             first=first, shared=shared)
        with Ring._agreed(comm, plan, spec, timeout, hosts, seq_axis, threads, False, check_finite) as ring:
            with limited(ring.threads), watching(ring._watch):
                return ring._forward(q, k, v, scale, record)


def ring_attention_backward(
    dout: np.ndarray,  # (..., Hq, n, Dv): the loss's gradient w.r.t. this rank's out
    q: np.ndarray, k: np.ndarray, v: np.ndarray,  # as ring_attention: (..., Hq|Hk, n, D), v (..., Hk, n, Dv)
    out: np.ndarray, lse: np.ndarray,  # what ring_attention returned: (..., Hq, n, Dv), (..., Hq, n)
    comm=None, *, causal: bool = False, scale: float | None = None, layout: str = "contiguous",
    mode: str = "ring", window: tuple[int, int] | None = None, cu_seqlens=None,
    timeout: float | str | None = "auto", record: Record | None = None, seq_axis: int = -2, threads="auto",
    dlse: np.ndarray | None = None, wire_dtype: str | None = None, grad_wire_dtype: str | None = None,
    positions=None, kv_positions=None, causal_block: int | None = None, node_size: int | None = None,
    ulysses_size: int | None = None, rotate: str = "kv", mask=None, softcap: float | None = None, bias=None,
    sinks=None, dropout: float = 0.0, seed: int = 0, spec: Spec | None = None, problem: str | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # dq, dk, dv (, dsinks): the shapes of q, k, v
    """Gradients ``(dq, dk, dv)`` of this rank's shard, given the upstream gradient ``dout``.

    ``out`` and ``lse`` are what ``ring_attention`` returned on this rank, with
    the same options: an lse from a forward with other options (layout, mode,
    causal, window, cu_seqlens, length, ranks or scale) raises ValueError on
    every rank. All arrays are this rank's shard in the same layout. dk and dv
    have the shape of k and v (grouped-query: summed over each group's query
    heads). Results have the input dtype (half inputs: lse is float32, as
    ring_attention returned it); every rank sums its own gradients in float64,
    and the dK/dV partials travel in ``grad_wire_dtype`` ("float32", the
    default, or "float64", the default for float64 inputs). K/V travel as
    ``wire_dtype`` says (as in ``ring_attention``: pass the forward's).
    ``dlse``: the gradient with respect to lse, if the loss uses it too.
    ``rotate``: the forward's, taken so one options dict serves both calls;
    whatever it was, the backward passes K/V and their dK/dV partials (the
    gradients are the same). Options are those of ``ring_attention``; bad input on any rank raises the
    same ValueError on every rank.
    """
    comm = check_comm(comm)
    with exclusive(comm):  # one call per communicator at a time (threads: one Dup each)
        first = problem  # the caller's: before any other
        spec, problem, same_rows = call_spec(
            spec, layout=layout, mode=mode, causal=causal, scale=scale, window=window, cu_seqlens=cu_seqlens,
            wire_dtype=wire_dtype, grad_wire_dtype=grad_wire_dtype, positions=positions, kv_positions=kv_positions,
            causal_block=causal_block, node_size=node_size, ulysses_size=ulysses_size, rotate=rotate, mask=mask,
            softcap=softcap, bias=bias, sinks=sinks, dropout=dropout, seed=seed)
        tensors = {"dout": dout, "q": q, "k": k, "v": v, "out": out}
        moved, moved_problem = moved_arrays(tensors, seq_axis, threads, same_rows, lse)
        if moved_problem is None:
            problem = (grad_problem(*moved, lse) or dlse_problem(dlse, lse) or problem
                       or spec.heads_problem(moved[1], moved[2], comm.Get_size()) or spec.scores_problem(moved[1])
                       or lse_problem(lse, spec, comm.Get_size(), moved[1]))
        problem = moved_problem or problem

        def prepare():  # what may fail on one rank alone (MemoryError) is done before the agreement
            arrays, lses = contiguous(dict(zip(tensors, moved)), [a for a in (lse, dlse) if a is not None])
            return arrays + lses

        hosts = Hosts()
        plan, spec, scale, arrays = setup(*moved[1:4], comm, spec, timeout=timeout, prepare=prepare, problem=problem,
                                          rows="qqkkq" + "l" * (1 if dlse is None else 2), hosts=hosts,
                                          same_rows=same_rows, first=first)
        with Ring._agreed(comm, plan, spec, timeout, hosts, seq_axis, threads, backward=True) as ring:
            with limited(ring.threads), watching(ring._watch):
                return ring._backward(arrays[:5], arrays[5:], scale, record)
