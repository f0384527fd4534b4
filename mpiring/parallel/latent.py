"""Multi-head latent attention (MLA) under context parallelism: the latent travels, not per-head K and V.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_latent_mpi.py

Every rank holds its tokens' queries q (..., H, n, d_nope + dr), latents
c_kv (..., 1, n, r) and rope keys k_rope (..., 1, n, dr), and the same
up-projections w_uk (H, r, d_nope) and w_uv (H, r, dv) (``core.mla``). The
strategy's own loops run unchanged with a ``LatentWire``: a block moves as
(c_kv, k_rope), coded as ``wire_dtype`` says, and is expanded per head where it
is used. The backward's dK/dV partials are folded into the latent before they
travel (dc_kv, dk_rope), and each rank's share of dW_UK, dW_UV is summed over
the ranks at the end (one all-reduce, counted in the record as a ring
all-reduce moves it; ``sum_weights=False`` leaves it to a caller that sums
every gradient anyway). Strategies that move K/V blocks take the latent (the
ring modes, the double ring, the sparse movement); Ulysses, the grid and
pass-Q move heads or queries and are refused.
"""

import time

import numpy as np
from mpi4py import MPI

from ..core.block import DELTA_DTYPE
from ..core.mla import Latent, LatentWire, expand, latent_problem
from ..core.precision import Precision, compute_dtype
from ..core.record import Record
from ..core.scores import Score
from ..core.tiles import release_workspace
from ..core.tuning.threads import limited, threads_for
from ..mpi.agree import agreed, check_comm, setup
from ..mpi.collectives import allreduced
from ..mpi.waits import exclusive, wait_until
from ..plans.checks import Shown, agreement_timeout, describe, resolve_timeout
from ..plans.spec import digest, spec_problem
from .strategies import Call, private_rings, run_backward, run_forward, strategy_of

__all__ = ["mla_attention", "mla_attention_backward", "FIELDS"]

FIELDS = ("seq_len", "layout", "positions", "kv_positions", "causal", "window", "cu_seqlens", "causal_block", "mask",
          "scale", "wire_dtype", "grad_wire_dtype", "accumulate", "mode", "rotate", "node_size")  # a Spec's, taken


def _agree(comm, tensors, weights, keywords, spec, timeout, rows, who):
    """Check and agree (the latent's own values, then ``agree.setup``): ``(plan, spec, scale, arrays, hosts)``."""
    spec, problem = spec_problem(keywords, spec)
    q, c, k_rope = tensors["q"], tensors["c_kv"], tensors["k_rope"]
    k = v = values = None
    try:
        problem = problem or spec.beyond(FIELDS, who) or latent_problem(q, c, k_rope, *weights)
        if problem is None and spec.rotate != "kv":
            problem = f"rotate={spec.rotate!r}: {who} moves the latent K/V, not queries (rotate='kv')"
        if problem is None:
            values = {"w_uk, w_uv (sha1 of their bytes)": Shown(tuple(digest(np.asarray(w))[:16] for w in weights))}
            k, v = (a.astype(q.dtype, copy=False) for a in expand(c, k_rope, *weights, compute_dtype(q.dtype)))
    except Exception as exc:  # noqa: BLE001 (reported collectively, never raised alone)
        problem = describe(exc)
    agreed(comm, problem, values, timeout, entry=True)
    work = compute_dtype(q.dtype) if "dout" in tensors else None  # the backward computes on these dtypes

    def prepare():  # the latent as it is (it travels in its dtype); the rest in the compute dtype (backward)
        return [np.ascontiguousarray(a, None if name in ("c_kv", "k_rope") else work) for name, a in tensors.items()]

    plan, spec, scale, arrays, hosts = setup(q, k, v, comm, spec, timeout=timeout, prepare=prepare, rows=rows)
    if not strategy_of(plan, spec.rotate).latent:
        raise ValueError(f"{who}: mode={spec.mode!r} moves heads, not K/V blocks: the latent cannot travel in "
                         f"their place; use mode ring, bidirectional, allgather, double_ring or sparse")
    return plan, spec, scale, arrays, hosts


def _run(comm, plan, spec, hosts, timeout, backward, body):
    """``body(plan, rings)`` on the call's private rings (freed after it), after a start barrier, with this rank's
    BLAS threads; a failure leaves no kept buffer that an abandoned receive may still fill (``release_workspace``)."""
    rank = comm.Get_rank()
    plan, rings = private_rings(comm, plan, spec.node_size, agreement_timeout(timeout), backward)
    try:
        wait_until([rings[0].comm.Ibarrier()], agreement_timeout(timeout), rank, "start barrier", sync=True)
        with limited(threads_for("auto", hosts, rank)):
            return body(plan, rings)
    except BaseException:
        release_workspace()
        raise
    finally:
        for ring in rings:
            ring.free()


def mla_attention(q, c_kv, k_rope, w_uk, w_uv, comm=None, *, spec=None, causal=False, layout="contiguous",
                  timeout="auto", record=None, **options):
    """This rank's ``(out, lse)`` of MLA: out (..., H, n, dv), lse (..., H, n); the latent travels.

    Args:
        q: (..., H, n, d_nope + dr) this rank's queries, [q_nope | q_rope].
        c_kv, k_rope: (..., 1, n_k, r) and (..., 1, n_k, dr): this rank's tokens' latents and rope keys.
        w_uk, w_uv: (H, r, d_nope) and (H, r, dv): the up-projections, the same on every rank.
        spec, options: a ``Spec``, or its fields as ``ring_attention`` takes them (scale defaults to
            1/sqrt(d_nope + dr)); those this call cannot run (score modifiers, Ulysses' and the grid's) are
            refused by name (``FIELDS``: what it takes).

    Bad input on any rank raises the same ValueError on every rank.
    """
    comm = check_comm(comm)
    with exclusive(comm):
        keywords = dict(options, causal=causal, layout=layout)
        plan, spec, scale, (q, c, k_rope), hosts = _agree(comm, dict(q=q, c_kv=c_kv, k_rope=k_rope), (w_uk, w_uv),
                                                          keywords, spec, timeout, "qkk", "mla_attention")
        rank = comm.Get_rank()
        record = Record(rank) if record is None else record
        precision = Precision.of(q.dtype, spec.precision)
        precision.wire = LatentWire(precision.wire, Latent(w_uk, w_uv, precision.compute))
        wait = resolve_timeout(timeout, plan, q.size // (q.shape[-2] * q.shape[-1]), q.shape[-1])

        def forward(plan, rings):
            return run_forward((q, c, k_rope), Call(plan, rings[:1], Score(scale), record, wait, precision))

        out, lse = _run(comm, plan, spec, hosts, timeout, False, forward)
        return plan.in_caller_order(rank, out), plan.in_caller_order(rank, lse, axis=-1)


def mla_attention_backward(dout, q, c_kv, k_rope, w_uk, w_uv, out, lse, comm=None, *, spec=None, timeout="auto",
                           **options):
    """This rank's ``(dq, dc_kv, dk_rope, dw_uk, dw_uv)`` from the forward's out and lse (the same options).

    The latent travels as in the forward pass, and the dK/dV partials of a block
    travel folded into the latent (dc_kv, dk_rope; in ``grad_wire_dtype``).
    ``dw_uk, dw_uv``: summed over every rank's tokens (the same on every rank);
    ``sum_weights=False``: this rank's share only. Results in the input dtype
    (the weights' gradients in the weights' dtype). ``options``: as ``mla_attention``'s, with ``record`` and
    ``sum_weights``.
    """
    comm = check_comm(comm)
    with exclusive(comm):
        record, sum_weights = options.pop("record", None), options.pop("sum_weights", True)
        keywords = options
        tensors = dict(dout=dout, q=q, c_kv=c_kv, k_rope=k_rope, out=out, lse=lse)
        plan, spec, scale, arrays, hosts = _agree(comm, tensors, (w_uk, w_uv), keywords, spec, timeout, "qqkkql",
                                                  "mla_attention_backward")
        dout, q, c, k_rope, out, lse = arrays
        rank, size = comm.Get_rank(), comm.Get_size()
        record = Record(rank) if record is None else record
        precision = Precision.of(c.dtype, spec.precision)
        latent = Latent(w_uk, w_uv, precision.compute)
        precision.wire = LatentWire(precision.wire, latent)
        delta = np.einsum("...d,...d->...", dout, out, dtype=DELTA_DTYPE).astype(q.dtype)
        wait = resolve_timeout(timeout, plan, q.size // (q.shape[-2] * q.shape[-1]), q.shape[-1], 2.5)

        def backward(plan, rings):
            call = Call(plan, rings, Score(scale), record, wait, precision)
            grads = run_backward((dout, q, c, k_rope, out, lse, delta), call)
            weights = latent.weight_grads
            if sum_weights and size > 1:
                start = time.perf_counter()
                weights = [allreduced(rings[0].comm, w, MPI.SUM, wait, "MLA weight gradients") for w in weights]
                for w in weights:  # as a ring all-reduce moves them: 2 (P - 1) chunks of 1/P
                    record.bytes_sent += 2 * (size - 1) * w.nbytes // size
                    record.messages += 2 * (size - 1)
                record.event("wait", start, step=plan.n_steps - 1, data="weight gradients")
            return grads, weights

        (dq, dc, dk_rope), weights = _run(comm, plan, spec, hosts, timeout, True, backward)
        grads = [plan.in_caller_order(rank, g.astype(precision.input, copy=False), kv=i > 0)
                 for i, g in enumerate((dq, dc, dk_rope))]
        return (*grads, *(w.astype(np.result_type(w0), copy=False) for w, w0 in zip(weights, (w_uk, w_uv))))
