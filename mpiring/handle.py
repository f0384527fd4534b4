"""A reusable ring for training loops: options agreed, plan built, communicators duplicated once.

    with mpiring.Ring(comm, seq_len, causal=True, layout="zigzag") as ring:
        for batch in batches:
            out, lse = ring.forward(q, k, v)
            dq, dk, dv = ring.backward(dout, q, k, v, out, lse)

Building a Ring agrees on its spec with one all-gather (``agree.setup_ring``);
every call checks its arrays on every rank and agrees with one small
all-reduce (``agree.check_call``), which is also the common start. Options
cannot be retyped, so a backward cannot differ from its forward.
``ring_attention`` and ``ring_attention_backward`` are one-call Rings: built
without ``seq_len``, a Ring agrees at its first call, the ranks' shards adding
up to the sequence. The lse a forward returns remembers the options that made it
(``Lse.made_by``): a backward given other options raises instead of returning
wrong gradients.
"""

import contextlib
import contextvars

import numpy as np

from .core.block import DELTA_DTYPE, Rowsum
from .core.kernels import default_scale
from .core.lse import Lse, mismatch
from .core.precision import Precision
from .core.record import Record
from .core.scores import FunctionFailed, Score
from .core.tiles import release_workspace
from .core.tuning.threads import limited, threads_for, threads_problem
from .mpi.agree import check_call, check_comm, contiguous, setup_ring
from .mpi.waits import Announced, CommTimeout, Watch, exclusive, watching
from .parallel.strategies import (
    Call,
    grad_rings,
    private_rings,
    rotation,
    run_backward,
    run_forward,
    scored_forward,
    sink_gradients,
    table_gradients,
)
from .plans.axes import axis_problem, seq_index
from .plans.call_options import CALL_OPTIONS, options_problem
from .plans.checks import (
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
from .plans.layouts import LAYOUTS, shard, take_rows
from .plans.spec import FIELDS, Spec, spec_problem

__all__ = ["Ring", "Lse", "Spec", "ring_attention", "ring_attention_backward", "caller_found"]

_CALLER = contextvars.ContextVar("mpiring_caller", default=(None, None))


@contextlib.contextmanager
def caller_found(problem, shared=None):
    """Around an adapter's call (``mpiring.torch``): its own ``problem`` with the call (a tensor it cannot take,
    an option it refuses) and ``shared``, what else every rank must pass alike (``{name: checks.Shown}``); both
    reach every rank through the call's agreement, the problem before any other."""
    token = _CALLER.set((problem, shared))
    try:
        yield
    finally:
        _CALLER.reset(token)


class Ring:
    """Context-parallel attention over ``comm``, agreed once and called many times.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD); one rank = one device.
        seq_len: tokens of the whole sequence (every rank holds its shard of it); None (and no ``positions``):
            the ranks' shards at the first call add up to it, and that call agrees on everything.
        spec: a ``Spec`` (``mpiring.plans.spec``) holding what the call computes and how its blocks move;
            options given beside it must equal its own.
        causal, layout, mode, options: the spec's fields as keywords (``Spec``: masks, scores, precision,
            strategy; the same on every rank).
        timeout: seconds a rank may wait for the others ("auto", a number or None; ``checks.resolve_timeout``).
        seq_axis: the sequence axis of q, k, v, out and dout (-2: ``(..., S, D)``;
            -3: flash-attn's ``(B, S, H, D)``), or the axes named, "bshd" or "bhsd"
            (``mpiring.plans.axes``). lse is always ``(..., H, S)``.
        threads: BLAS threads per rank inside every call: "auto" (the node's
            cores shared among its ranks; ``mpiring.core.tuning.threads``), an int, or None
            (leave BLAS alone).
        check_finite: also reject NaN/Inf in q, k, v (one extra pass), and NaN/+Inf values from a ``bias``.
        expected_size: raise unless the communicator has this many ranks.

    Construction is collective (one all-gather, and communicator duplicates
    freed by ``close()`` or on leaving a ``with`` block); so is every call.
    Bad arguments raise the same ValueError on every rank and leave the handle
    usable; a call that fails in the ring (CommTimeout, an interrupt) leaves it
    closed.
    """

    def __init__(self, comm=None, seq_len=None, *, spec: Spec | None = None, causal: bool = False,
                 layout: str = "contiguous", mode: str = "ring", timeout: float | str | None = "auto",
                 seq_axis: int | str = -2, threads="auto", check_finite: bool = False,
                 expected_size: int | None = None, **options):
        self._comm = check_comm(comm)
        spec, problem = spec_problem(dict(options, seq_len=seq_len, causal=causal, layout=layout, mode=mode), spec)
        self._problem = axis_problem({}, seq_axis) or threads_problem(threads) or problem
        self.spec, self.plan, self.check_finite, self.seq_axis = spec, None, check_finite, seq_axis
        self._timeout, self._threads, self._expected_size = timeout, threads, expected_size
        self._failed, self._rings, self._watch, self._grad_rings = None, [], None, False
        self.rank, self.size = self._comm.Get_rank(), self._comm.Get_size()
        if spec is None or spec.seq_len is not None or spec.positions is not None:  # the backward's comms: lazily
            self._agree(_CALLER.get()[0] or self._problem, None, backward=False)

    def _agree(self, problem, length, backward):
        """The Ring's agreement (one all-gather): its spec, its run options and, without a ``seq_len``, every rank's
        ``length`` of q; then the plan, and the private communicators (``backward``: the backward's too)."""
        run = dict(seq_axis=self.seq_axis, threads=self._threads)  # check_finite: each rank's own arrays
        with exclusive(self._comm):
            plan, self.spec, hosts = setup_ring(self._comm, self.spec, self._timeout, self._expected_size, problem,
                                                values=run, length=length)
            self.seq_axis = self.seq_axis if isinstance(self.seq_axis, str) else int(self.seq_axis)
            self.threads = threads_for(self._threads, hosts, self.rank)
            # private duplicates: K/V; and what the strategy's backward needs (the ring modes: dK/dV onward and home)
            self.plan, self._rings = private_rings(self._comm, plan, self.spec.node_size,
                                                   agreement_timeout(self._timeout), backward)
        self._grad_rings = backward
        self._watch = Watch(self._rings[0].comm, getattr(hosts, "token", 0))  # the others' failure notices

    def _ready(self, tensors, lse=None):
        """Agree now if this Ring waited for its first call (no ``seq_len``): this rank's q gives its length."""
        backward = lse is not None
        if self.plan is None:
            problem, length = _CALLER.get()[0] or self._problem, None
            if problem is None:
                try:  # the arrays' own checks first: a rank without tokens is named, not the plan it would make
                    problem = axis_problem(tensors, self.seq_axis, lse=lse)
                    if problem is None:
                        q, k, v = (np.moveaxis(tensors[n], seq_index(self.seq_axis, tensors[n].ndim), -2)
                                   for n in "qkv")
                        problem = local_problem(q, k, v, None, False, self.spec.same_rows)
                        length = q.shape[-2]
                except Exception as exc:  # reported collectively, never raised alone
                    problem = describe(exc)
            self._agree(problem, length, backward)
        elif backward and not self._grad_rings and not self._failed:  # a forward-only start: add the backward's
            self._rings += grad_rings(self._comm, self.plan, agreement_timeout(self._timeout))
            self._grad_rings = True

    # ------------------------------------------------------------------ the handle's life

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Free the private communicators (collective only in that every rank should close its handle)."""
        if self._watch is not None:
            self._watch.close()
        for ring in self._rings:
            ring.free()  # pending transfers, after a failure, are abandoned, never cancelled
        self._rings = []
        self._failed = self._failed or "it was closed"

    # ------------------------------------------------------------------ the options, read-only

    @property
    def options(self):
        """The options a call may repeat (``mpiring.plans.call_options.CALL_OPTIONS``), as this Ring holds them."""
        held = {name: getattr(self.spec, name) for name in CALL_OPTIONS if name in FIELDS}
        return dict(held, layout=self.layout, window=tuple(self.spec.window), timeout=self._timeout,
                    seq_axis=self.seq_axis, check_finite=self.check_finite)

    scale = property(lambda self: self.spec.scale,
                     doc="The softmax scale given to the Ring, a float; None: each call's 1/sqrt(head dim of q).")
    causal = property(lambda self: self.spec.causal)
    layout = property(lambda self: self.spec.layout if self.plan is None else self.plan.layout,
                      doc="The layout, or 'positions' when positions were given.")
    mode = property(lambda self: self.spec.mode)
    window = property(lambda self: tuple(self.spec.window), doc="(left, right), -1 unbounded.")
    cu_seqlens = property(lambda self: self.spec.cu_seqlens)
    seq_len = property(lambda self: self.spec.seq_len if self.plan is None else self.plan.seq_len,
                       doc="Tokens of the whole sequence; None until the first call of a Ring built without it.")
    timeout = property(lambda self: self._timeout)

    def _agreed_plan(self):
        if self.plan is None:
            raise RuntimeError("this Ring was built without seq_len: its shards are known after its first call")
        return self.plan

    @property
    def positions(self):
        """The global positions of this rank's query rows (for RoPE or position embeddings), in its row order."""
        plan = self._agreed_plan()
        return plan.in_caller_order(self.rank, plan.shards[self.rank], axis=-1)

    def shard(self, x, axis=None):
        """This rank's part of a full array ``x``, the sequence on ``axis`` (default: this handle's seq_axis).

        A view for the contiguous and striped layouts, a copy otherwise (``mpiring.shard``).
        """
        axis = seq_index(self.seq_axis if axis is None else axis, np.ndim(x))
        if self._agreed_plan().layout in LAYOUTS:  # the layout's tokens, in every mode
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

    def forward(self, q, k, v, *, record: Record | None = None, **options):
        """This rank's ``(out, lse)``: out shaped as q with v's head dim, lse ``(..., Hq, n)`` (an ``Lse``).

        ``options``: any of the Ring's own (``scale=``, ``causal=``, ...; ``mpiring.plans.call_options``), as a
        model passes them at every call: equal to the Ring's or refused. ``record``: a ``Record`` to fill
        with tasks, events and traffic counters.
        """
        tensors = {"q": q, "k": k, "v": v}
        self._ready(tensors)
        with self._call():
            (q, k, v), _, scale, timeout = self._agree_call(tensors, None, None, options)
            return self._forward(q, k, v, scale, record, timeout)

    def backward(self, dout, q, k, v, out, lse, *, dlse=None, record: Record | None = None, **options):
        """This rank's ``(dq, dk, dv)`` (shapes and dtypes of q, k, v) from the forward's out and lse.

        ``dlse``: the loss's gradient with respect to lse, when lse is used
        too (as by a PyTorch graph); it enters as ``delta - dlse``. ``options``, ``record``: as ``forward``.
        """
        arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out}
        self._ready(arrays, lse)
        with self._call():
            moved, lses, scale, timeout = self._agree_call(arrays, lse, dlse, options)
            return self._backward(moved, lses, scale, record, timeout)

    def _agree_call(self, tensors, lse, dlse, options):
        """Move the sequence to axis -2, check on this rank, agree on every rank; contiguous arrays, the scale and the
        timeout of every wait. An adapter's problem and shared values (``caller_found``) come first."""
        moved, lses, values, peak, timeout = [], [], None, [0.0, 0.0], None
        problem, shared = _CALLER.get()
        same_rows = self.spec.same_rows
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
                    problem = (self.spec.backward_problem() or grad_problem(names["dout"], q, k, v, names["out"], lse)
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

    def _forward(self, q, k, v, scale, record, timeout):
        """The ring's forward on agreed arrays (``_agree_call``)."""
        record = Record(self.rank) if record is None else record
        score = Score.of(self.spec, scale, q, finite=self.check_finite)
        call = Call(self.plan, self._rings[:1], score, record, timeout, Precision.of(q.dtype, self.spec.precision),
                    rotation(self.spec.rotate, self.plan, q, k, v, self.spec.wire_dtype))
        with self._running():
            out, lse = run_forward((q, k, v), call)
            out, lse, top = scored_forward(self.spec, score, out, lse, self._rings[0].comm, timeout)
        out, lse = self.plan.in_caller_order(self.rank, out), self.plan.in_caller_order(self.rank, lse, axis=-1)
        lse = lse.view(Lse)
        lse.made_by = self.spec.made_by(self.size, scale, self.plan.seq_len)
        out = np.moveaxis(out, -2, seq_index(self.seq_axis, out.ndim))
        return (out, lse) if top is None else (out, lse, top[0] if q.ndim == 2 else top)

    def _backward(self, moved, lses, scale, record, timeout):
        """The ring's backward on agreed arrays (``_agree_call``)."""
        dout, q, k, v, out = moved
        precision = Precision.of(k.dtype, self.spec.precision)
        delta = np.einsum("...d,...d->...", dout, out, dtype=DELTA_DTYPE)  # no float64 copies of dout and out
        if len(lses) > 1:  # d lse / d score = p: the dlse term joins delta (ds = p * (dp - delta + dlse))
            delta -= lses[1]
        computed = delta.astype(q.dtype)
        if len(lses) == 1 and np.isfinite(delta).all():  # the rowsum of finite dout, out: no block checks it again
            computed = computed.view(Rowsum)
        record = Record(self.rank) if record is None else record
        score = Score.of(self.spec, scale, finite=self.check_finite, backward=True)
        call = Call(self.plan, self._rings, score, record, timeout, precision)
        with self._running():
            grads = run_backward((dout, q, k, v, out, lses[0], computed), call)
            dsinks = sink_gradients(self.spec, lses[0], delta, self._rings[0].comm, timeout)
            dtable = table_gradients(score, self._rings[0].comm, timeout)
        grads = [self.plan.in_caller_order(self.rank, g.astype(precision.input, copy=False), kv=i > 0)
                 for i, g in enumerate(grads)]
        grads = tuple(np.moveaxis(g, -2, seq_index(self.seq_axis, g.ndim)) for g in grads)
        return grads + tuple(g for g in (dsinks, dtable) if g is not None)


# ---------------------------------------------------------------------- the plain functions


def ring_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, comm=None, *, spec: Spec | None = None,
                   causal: bool = False, layout: str = "contiguous", mode: str = "ring",
                   timeout: float | str | None = "auto", record: Record | None = None, **options):
    """Attention of this rank's queries against the whole distributed sequence: a one-call ``Ring``.

    Every rank passes its local shard of q ``(..., Hq, n, D)``, k ``(..., Hk, n, D)`` and v ``(..., Hk, n, Dv)``
    (Hq a multiple of Hk; the ``layout`` says which tokens it holds) and gets its ``(out, lse)`` back: out
    ``(..., Hq, n, Dv)`` and the log-sum-exp ``(..., Hq, n)``.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD); one rank = one device.
        spec: a ``Spec`` holding the options instead; options passed beside it must equal its own.
        causal: token t attends only to tokens <= t.
        layout: "contiguous", "zigzag" or "striped" (``mpiring.plans.layouts``).
        mode: "ring", "bidirectional", "allgather", "ulysses", "double_ring" or "sparse" (``Spec``).
        timeout: seconds a rank may wait for the others before raising ``CommTimeout`` ("auto": 60 s for
            ranks to arrive, then 60 s plus the busiest rank's FLOPs at 1e8 FLOP/s per wait; None: forever).
        record: a ``Record`` to fill with tasks, events and traffic counters.
        options: every other field of ``Spec`` (scale, window, cu_seqlens, positions, masks, scores, precision,
            strategy; docs/masks.md) and the ``Ring``'s run options (seq_axis, threads, check_finite,
            expected_size). With ``sinks`` the backward returns ``(dq, dk, dv, dsinks)``, with
            ``return_max_logit`` the forward ``(out, lse, max_logit)``.

    float16 and bfloat16 inputs compute in float32: out comes back in the input
    dtype, lse in float32. Bad arguments on any rank raise the same ``ValueError`` on every rank,
    before any transfer (see docs/reliability.md). Each call agrees and
    duplicates the communicator anew; ``mpiring.Ring`` does that once.
    """
    comm = check_comm(comm)
    with exclusive(comm), Ring(comm, spec=spec, causal=causal, layout=layout, mode=mode, timeout=timeout,
                               **options) as ring:  # one call per communicator at a time (threads: one Dup each)
        return ring.forward(q, k, v, record=record)


def ring_attention_backward(dout: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray,
                            lse: np.ndarray, comm=None, *, spec: Spec | None = None,
                            timeout: float | str | None = "auto", record: Record | None = None,
                            dlse: np.ndarray | None = None, **options):
    """Gradients ``(dq, dk, dv)`` of this rank's shard, given the upstream gradient ``dout``: a one-call ``Ring``.

    ``out`` and ``lse`` are what ``ring_attention`` returned on this rank, with
    the same options (``options``: as ``ring_attention``'s): an lse from a forward with other options (layout,
    mode, causal, window, cu_seqlens, length, ranks or scale) raises ValueError on
    every rank. dk and dv have the shape of k and v (grouped-query: summed over each group's query
    heads). Results have the input dtype (half inputs: lse is float32, as
    ring_attention returned it); the dK/dV partials travel in ``grad_wire_dtype``
    ("float32", the default, or "float64", the default for float64 inputs), and
    every rank sums its own gradients in that dtype (float32 at least). ``dlse``: the gradient with respect to lse,
    if the loss uses it too. Whatever ``rotate`` was, the backward passes K/V and their dK/dV partials.
    """
    comm = check_comm(comm)
    with exclusive(comm), Ring(comm, spec=spec, timeout=timeout, **options) as ring:
        return ring.backward(dout, q, k, v, out, lse, dlse=dlse, record=record)
