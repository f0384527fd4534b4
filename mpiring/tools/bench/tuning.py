"""``bench tune``: which GEMM backend and tile sizes run the NumPy kernel fastest on this CPU, cached.

    python -m mpiring bench tune                   # D 64 and 128, float32 (under a minute)
    python -m mpiring bench tune --dims 64 --dtypes float32 --repeats 3
    python -m mpiring bench tune --show            # the cached choice for this machine, timing nothing

No MPI. Run it on an idle machine (the timings pick the winner); every later
process on this machine reads the cache (``mpiring.core.tuning.machine``).
"""

import json

from mpiring.core.tuning import gemm
from mpiring.core.tuning.machine import cache_path, cached, machine_key
from mpiring.core.tuning.tune import tune as run_tune

from ..cli import at_least, command_parser

__all__ = ["tune", "tune_parser"]


def tune_parser():
    p = command_parser("bench tune", tune)
    p.add_argument("--dims", type=int, nargs="+", default=[64, 128], metavar="D", help="head dims")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "float64"],
                   help="compute dtypes (half inputs compute in float32)")
    p.add_argument("--seq", type=int, default=2048, help="tokens of the timed block (queries = keys)")
    p.add_argument("--heads", type=int, default=8, help="heads of the timed block")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per candidate (the fastest counts)")
    p.add_argument("--backends", nargs="+", choices=gemm.BACKENDS, help="GEMM backends to try "
                   "(default: every one installed here)")
    p.add_argument("--show", action="store_true", help="print the cached choice for this machine and stop")
    p.add_argument("--no-write", action="store_true", help="time and print, but leave the cache alone")
    p.checks.append(at_least(1, **{"--seq": "seq", "--heads": "heads", "--repeats": "repeats"}))
    p.checks.append(lambda a: next((f"--dims {d}: must be at least 1" for d in a.dims if d < 1), None))
    p.checks.append(lambda a: next((f"--backends {b}: not installed here (pip install mpiring[mkl])"
                                    for b in a.backends or [] if b not in gemm.available()), None))
    return p


def tune(comm=None, args=None):
    """Time GEMM backends and tile sizes on one core of this CPU; cache the fastest here."""
    args = tune_parser().parse_args(args)
    path = cache_path()
    print(f"machine: {machine_key()}")
    print(f"cache: {path or 'off (MPIRING_TUNE_CACHE=off)'}")
    if args.show:
        entry = cached()
        print(json.dumps(entry, indent=1, sort_keys=True) if entry else "nothing cached for this machine")
        return 0
    entry = run_tune(dims=args.dims, dtypes=args.dtypes, seq=args.seq, heads=args.heads, repeats=args.repeats,
                     backends=args.backends, write=not args.no_write)
    print(f"\nfastest backend: {entry['gemm']} (total s: "
          + ", ".join(f"{k} {v:.3f}" for k, v in entry["backend_seconds"].items()) + ")")
    for kind, table in entry["tiles"].items():
        for dtype, dims in table.items():
            print(f"  {kind} {dtype}: " + ", ".join(f"D={d} tiles {tq} x {tk}" for d, (tq, tk) in dims.items()))
    print("cached" if path and not args.no_write else "not cached (--no-write or cache off)")
    return 0
