"""``bench accuracy``: how the error against float64 grows with P, per input dtype and accumulation dtype.

    python -m mpiring bench accuracy --seq-len 2048 --heads 4 --dim 64 --causal
    python -m mpiring bench accuracy --dtype float32 --wire-dtype float8_e4m3 --ranks 1 2 4 8 --backward

No MPI: the one-process simulator (``mpiring.simulate``, ``simulate_backward``)
runs every rank's part of the ring with the same kernels, merges, wire coding
and accumulators as ``ring_attention`` (and its backward, the partials summed
in ``grad_wire_dtype`` as they travel), on unit-normal inputs rounded to each
dtype; the reference is float64 attention of those rounded inputs
(``mpiring.testing.reference``). Errors as ``mpiring.testing.TOLERANCE``
bounds them: absolute on out, relative to max(1, max|ref|) on dq, dk, dv.
"""

import numpy as np

from mpiring.core.precision import ACCUMULATE, INPUT_DTYPES, WIRE_DTYPES, named_dtype
from mpiring.simulate import simulate, simulate_backward
from mpiring.testing import attention_error, reference, reference_backward

from ..cli import at_least, command_parser

__all__ = ["accuracy", "accuracy_parser", "error_growth"]


def accuracy_parser():
    p = command_parser("bench accuracy", accuracy)
    p.add_argument("--seq-len", type=int, default=2048, help="tokens of the whole sequence")
    p.add_argument("--heads", type=int, default=4, help="heads (K/V heads too)")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--causal", action="store_true", help="causal mask (zigzag layout)")
    p.add_argument("--ranks", type=int, nargs="+", default=list(range(1, 9)), metavar="P", help="ring sizes")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=INPUT_DTYPES,
                   help="input dtypes")
    p.add_argument("--accumulate", nargs="+", default=list(ACCUMULATE), choices=ACCUMULATE,
                   help="dtypes of the running (out, lse)")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, help="K/V coded on the wire (default: the input dtype)")
    p.add_argument("--backward", action="store_true", help="also the gradients: the largest error of dq, dk, dv "
                   "relative to max(1, max |reference|), and its mean")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs")
    p.checks.append(at_least(1, **{"--seq-len": "seq_len", "--heads": "heads", "--dim": "dim"}))
    p.checks.append(lambda a: next((f"--ranks {P}: must be 1 .. --seq-len" for P in a.ranks
                                    if not 1 <= P <= a.seq_len), None))
    return p


def error_growth(seq_len, heads, dim, ranks, dtype, accumulate, causal=False, wire_dtype=None, seed=0,
                 backward=False):
    """``{P: (max error, mean error)}`` of out against float64, for one input dtype and accumulation dtype;
    ``backward``: ``{P: ((max, mean) of out, (max, mean) of the gradients)}``, the gradients' largest error of
    dq, dk, dv relative to max(1, max|ref|) and the mean of their absolute errors over max(1, max|ref|)."""
    rng = np.random.default_rng(seed)
    Q, K, V, dO = (rng.standard_normal((heads, seq_len, dim)).astype(named_dtype(dtype)) for _ in range(4))
    exact = [a.astype(np.float64) for a in (Q, K, V, dO)]
    ref, _ = reference(*exact[:3], causal=causal)
    refs = reference_backward(exact[3], *exact[:3], causal=causal) if backward else ()
    options = dict(causal=causal, layout="zigzag" if causal else "contiguous", wire_dtype=wire_dtype)
    result = {}
    for P in ranks:
        out, lse, _ = simulate(Q, K, V, P, accumulate=accumulate, **options)
        err = np.abs(out.astype(np.float64) - ref)
        result[P] = (float(err.max()), float(err.mean()))
        if backward:
            grads = simulate_backward(dO, Q, K, V, out, lse, P, **options)
            worst = max(attention_error(g, r, name)[0] for g, r, name in zip(grads, refs, ("dq", "dk", "dv")))
            mean = max(float(np.mean(np.abs(g.astype(np.float64) - r))) / max(1.0, float(np.abs(r).max()))
                       for g, r in zip(grads, refs))
            result[P] = (result[P], (worst, mean))
    return result


def accuracy(comm=None, args=None):
    """Print how the error of out (and with --backward of dq, dk, dv) against float64 grows with P, for each
    input dtype and accumulation dtype."""
    args = accuracy_parser().parse_args(args)
    for name in args.dtype + [args.wire_dtype or "float64"]:
        named_dtype(name)  # bfloat16 or FP8 without ml_dtypes: a clear error before any work
    print(f"max and mean |out - float64 reference| over {args.heads} heads x {args.seq_len} tokens x dim "
          f"{args.dim}{', causal zigzag' if args.causal else ''}; K/V on the wire: "
          f"{args.wire_dtype or 'the input dtype'}; simulated ring, P ranks"
          + ("; grads: dq, dk, dv relative to max(1, max |ref|), the largest (partials in the default "
             "grad_wire_dtype)" if args.backward else ""))
    print(f"{'input':<9}{'accumulate':<11}{'pass':<6}" + "".join(f"{'P=' + str(P):>19}" for P in args.ranks))
    for dtype in args.dtype:
        for acc in args.accumulate:
            growth = error_growth(args.seq_len, args.heads, args.dim, args.ranks, dtype, acc, args.causal,
                                  args.wire_dtype, args.seed, args.backward)
            rows = [("out", growth.values())]
            if args.backward:
                rows = [("out", [f for f, _ in growth.values()]), ("grads", [b for _, b in growth.values()])]
            for name, values in rows:
                print(f"{dtype:<9}{acc:<11}{name:<6}" + "".join(f"{m:>10.2e}/{a:.2e}" for m, a in values))
    return 0
