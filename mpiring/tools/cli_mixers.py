"""``run --mixer``: a sequence mixer on seeded inputs under mpiexec, checked against the float64 recurrence.

    mpiexec -n 4 python -m mpiring run --mixer gdn --seq-len 512 --layout zigzag --passing scan --backward
    mpiexec -n 2 python -m mpiring run --mixer conv --cu-seqlens 0 100 512 --seq-len 512

Every rank draws the whole sequence's inputs from the seed, runs the mixer on
its shard (``mpiring.shard_indices``), and compares its rows with the
token-by-token float64 loop of ``mpiring.core.mixers.sequential`` over the
whole sequence (forward, and with ``--backward`` every gradient; the shared
weights' summed over ranks). Rank 0 prints each rank's bytes against the
byte model, the largest errors, and VERIFIED or what failed.
"""

import numpy as np

from mpiring import (
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
from mpiring.core.precision import compute_dtype, named_dtype
from mpiring.cost.statebytes import halo_bytes, state_bytes
from mpiring.plans.chunks import PASSING

from . import verify

__all__ = ["MIXERS", "add_mixer_args", "run_mixer", "mixer_inputs"]

# conv: causal depthwise convolution; linear: a decay per head; gla: a decay per key dimension; gdn: the
# gated delta rule; ssd: Mamba-2 (2 heads per group of B, C); mamba: Mamba-1's selective scan
MIXERS = ("conv", "linear", "gla", "gdn", "ssd", "mamba")


def add_mixer_args(p):
    p.add_argument("--mixer", choices=MIXERS, help="run a sequence mixer instead of attention (docs/mixers.md): "
                   "conv, linear (a decay per head), gla (per key dim), gdn (gated delta rule), ssd (Mamba-2), "
                   "mamba (Mamba-1's selective scan)")
    p.add_argument("--passing", choices=PASSING, default="allgather",
                   help="--mixer: how states pass between ranks (LASP's ring, LASP-2's all-gather, a prefix scan)")
    p.add_argument("--width", type=int, default=4, help="--mixer conv: the kernel width")
    p.add_argument("--state", type=int, default=16, help="--mixer ssd, mamba: the state size N")


def mixer_inputs(args, dtype=np.float64):
    """The whole sequence's inputs of ``args.mixer`` from the seed (the same on every rank) and their sequence
    axes (None: a weight every rank holds whole)."""
    rng = np.random.default_rng(args.seed)
    B, H, D, S, N = args.batch, args.heads, args.dim, args.seq_len, args.state

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    if args.mixer == "conv":
        return dict(x=normal(B, S, H * D), weight=normal(H * D, args.width), bias=normal(H * D)), \
            dict(x=-2, weight=None, bias=None)
    if args.mixer == "ssd":
        groups = max(H // 2, 1)
        arrays = dict(x=normal(B, H, S, D), dt=(0.5 * rng.random((B, H, S))).astype(dtype),
                      A=-rng.random(H).astype(dtype), B=normal(B, groups, S, N), C=normal(B, groups, S, N),
                      D=normal(H))
        return arrays, dict(x=-2, dt=-1, A=None, B=-2, C=-2, D=None)
    if args.mixer == "mamba":
        arrays = dict(x=normal(B, H * D, S), dt=(0.5 * rng.random((B, H * D, S))).astype(dtype),
                      A=-rng.random((H * D, N)).astype(dtype), B=normal(B, S, N), C=normal(B, S, N), D=normal(H * D))
        return arrays, dict(x=-1, dt=-1, A=None, B=-2, C=-2, D=None)
    q, k, v = normal(B, H, S, D), normal(B, H, S, D), normal(B, H, S, D)
    decay = -0.5 * rng.random((B, H, S, D) if args.mixer == "gla" else (B, H, S))
    arrays = dict(q=q, k=k, v=v, decay=decay.astype(dtype), beta=None)
    axes = dict(q=-2, k=-2, v=-2, decay=-2 if args.mixer == "gla" else -1, beta=-1)
    if args.mixer == "gdn":
        arrays["k"] = (k / np.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
        arrays["beta"] = rng.random((B, H, S)).astype(dtype)
    return arrays, axes


def _reference(args, arrays, dy, starts):
    """Output and gradients of the whole sequence by the float64 loops."""
    a64 = {n: None if a is None else a.astype(np.float64) for n, a in arrays.items()}
    dy = dy.astype(np.float64)
    if args.mixer == "conv":
        y = conv(a64["x"], a64["weight"], a64["bias"], starts)
        return y, list(conv_backward(dy, a64["x"], a64["weight"], a64["bias"], starts)) if args.backward else []
    if args.mixer in ("ssd", "mamba"):
        mapping, grads = (ssd_inputs, ssd_grads) if args.mixer == "ssd" else (scan_inputs, scan_grads)
        q, k, v, g = mapping(*(a64[n] for n in "x dt A B C".split()))
        beta, scale = None, 1.0
    else:
        q, k, v, g, beta = (a64[n] for n in ("q", "k", "v", "decay", "beta"))
        scale = 1 / np.sqrt(q.shape[-1])
    Z, S = int(np.prod(v.shape[:-2])), v.shape[-2]
    flat = [None if a is None else np.reshape(a, (Z, S) + a.shape[v.ndim - 1:]) for a in (q * scale, k, v, g, beta)]
    out = recurrence(*flat[:3], g=flat[3], beta=flat[4], starts=starts)[0].reshape(v.shape)
    if args.mixer in ("ssd", "mamba"):
        x, D = a64["x"], a64["D"]
        out = out[..., 0] + D[:, None] * x if args.mixer == "mamba" else out + D[:, None, None] * x
    if not args.backward:
        return out, []
    dout = (dy[..., None] if args.mixer == "mamba" else dy).reshape(flat[2].shape)
    dq, dk, dv, dg, db, _ = recurrence_backward(dout, *flat[:3], g=flat[3], beta=flat[4], starts=starts)
    if args.mixer not in ("ssd", "mamba"):
        return out, [dq.reshape(q.shape) * scale, dk.reshape(k.shape), dv.reshape(v.shape), dg.reshape(g.shape),
                     None if beta is None else db.reshape(beta.shape)]
    parts = [a.reshape(p.shape) for a, p in zip((dq, dk, dv, dg), (q, k, v, g))]
    return out, list(grads(RecurrenceGrads(*parts), dy, a64["x"], a64["dt"], a64["A"], a64["B"], a64["D"]))


def _call(args, local, dy, comm, options, records):
    """This rank's output and gradients (an empty list without --backward)."""
    m, backward = args.mixer, args.backward
    if m == "conv":
        y = causal_conv(local["x"], local["weight"], local["bias"], comm, record=records[0], **options)
        grads = causal_conv_backward(dy, local["x"], local["weight"], local["bias"], comm, record=records[1],
                                     **options) if backward else []
        return y, list(grads)
    if m in ("ssd", "mamba"):
        forward, back = (ssd, ssd_backward) if m == "ssd" else (selective_scan, selective_scan_backward)
        y, carry = forward(**local, comm=comm, record=records[0], **options)
        grads = back(dy, **local, carry=carry, comm=comm, record=records[1], **options) if backward else []
        return y, list(grads)
    q, k, v, decay, beta = (local[n] for n in ("q", "k", "v", "decay", "beta"))
    out, carry = linear_attention(q, k, v, comm, decay=decay, beta=beta, record=records[0], **options)
    grads = linear_attention_backward(dy, q, k, v, carry, comm, decay=decay, beta=beta, record=records[1],
                                      **options) if backward else []
    return out, list(grads)


def _predicted(args, plan, arrays, backward):
    """Bytes each rank sends, by the byte model, in the dtype the mixer computes in."""
    itemsize = compute_dtype(named_dtype(args.dtype)).itemsize
    if args.mixer == "conv":
        return halo_bytes(plan, args.width, arrays["x"].shape[0] * arrays["x"].shape[-1], itemsize, backward)
    B, H, D, N = args.batch, args.heads, args.dim, args.state
    state, transition = {"linear": (B * H * D * D, B * H), "gla": (B * H * D * D, B * H * D),
                         "gdn": (B * H * D * D, B * H * D * D), "ssd": (B * H * N * D, B * H),
                         "mamba": (B * H * D * N, B * H * D * N)}[args.mixer]
    return state_bytes(plan, args.passing, state, transition, itemsize, backward)


def _errors(args, comm, mine, axes, out, grads, ref_out, ref_grads, out_axis):
    """The largest error of the output and each gradient on this rank (relative to max(1, max |ref|) for the
    gradients; the shared weights' summed over ranks first)."""
    errors = {"out": float(np.max(np.abs(out - np.take(ref_out, mine, axis=out_axis))))}
    for name, got, want in zip(axes, grads, ref_grads):
        if got is None:
            continue
        got = comm.allreduce(got.astype(np.float64)) if axes[name] is None else got
        want = want if axes[name] is None else np.take(want, mine, axis=axes[name])
        errors[f"d{name}"] = float(np.max(np.abs(got - want))) / max(1.0, float(np.max(np.abs(want))))
    return errors


def run_mixer(comm, args):
    """Rank 0's report of ``run --mixer``: bytes against the model, errors against float64; its exit code."""
    rank, size = comm.Get_rank(), comm.Get_size()
    dtype = named_dtype(args.dtype)
    arrays, axes = mixer_inputs(args, dtype)
    cu = None if args.cu_seqlens is None else list(args.cu_seqlens)
    starts = None if cu is None else np.isin(np.arange(args.seq_len), cu[:-1])
    mine = shard_indices(args.seq_len, size, rank, args.layout)
    local = {n: a if a is None or axes[n] is None else np.take(a, mine, axis=axes[n]) for n, a in arrays.items()}
    out_axis = -1 if args.mixer == "mamba" else -2
    main = arrays["x"] if "x" in arrays else arrays["v"]
    full_dy = np.random.default_rng(args.seed + 1).standard_normal(main.shape).astype(dtype)
    options = dict(seq_len=args.seq_len, layout=args.layout, cu_seqlens=cu, passing=args.passing)
    options.pop("passing") if args.mixer == "conv" else None
    records = Record(rank), Record(rank)
    out, grads = _call(args, local, np.take(full_dy, mine, axis=out_axis), comm, options, records)
    ref_out, ref_grads = _reference(args, arrays, full_dy, starts)
    errors = _errors(args, comm, mine, axes, out, grads, ref_out, ref_grads, out_axis)
    rows = comm.gather((records[0].bytes_sent, records[1].bytes_sent, records[0].wall_time + records[1].wall_time,
                        errors), root=0)
    if rank != 0:
        return 0
    plan = MixerSpec.of(**options).plan(size)
    predicted = [_predicted(args, plan, arrays, back) for back in (False, True)]
    print(f"mpiring run --mixer {args.mixer}: P={size} seq_len={args.seq_len} batch={args.batch} heads={args.heads} "
          f"dim={args.dim} {dtype} layout={args.layout} cu_seqlens={cu}"
          + ("" if args.mixer == "conv" else f" passing={args.passing}") + f" chunks={plan.chunks}")
    print("\nrank  fwd bytes  predicted  bwd bytes  predicted  wall s")
    failed = []
    for r, (fwd, bwd, wall, _) in enumerate(rows):
        back = predicted[1][r] if args.backward else 0
        print(f"{r:>4}  {fwd:>9}  {predicted[0][r]:>9}  {bwd:>9}  {back:>9}  {wall:>6.3f}")
        if fwd != predicted[0][r] or bwd != back:
            failed.append(f"rank {r} sent {fwd} + {bwd} bytes, the model says {predicted[0][r]} + {back}")
    worst = {name: max(row[3].get(name, 0.0) for row in rows) for name in rows[0][3]}
    tol = verify.run_tolerance(dtype, None)
    print("\nlargest error against the float64 recurrence (gradients relative to max(1, max |ref|)):")
    print("  " + "  ".join(f"{name} {err:.2e}" for name, err in worst.items()) + f"  (tolerance {tol:g})")
    failed += [f"{name} is off by {err:.3g}" for name, err in worst.items() if not err <= tol]
    for line in failed:
        print(f"FAILED {line}")
    print("VERIFICATION FAILED" if failed else "VERIFIED" + ("" if args.backward else " (forward; --backward "
                                                                                     "checks the gradients too)"))
    return 1 if failed else 0
