"""``bench mixers``: the sequence mixers on P ranks against transformers' CPU code in one process.

    mpiexec -n 2 python -m mpiring bench mixers          # the rows of docs/performance.md section 18

Each row times one mixer through ``mpiring.torch``, forward and forward+backward, on P ranks x 1 thread
(zigzag shards, states all-gathered), then transformers' own function on the whole sequence with P threads
(``peers``). Wall: the slowest rank's median; "x torch": torch's seconds over mpiring's; bytes: the most any
rank sent, against ``mpiring.cost.statebytes``. Float32, batch 1.
"""

import time

from mpi4py import MPI

from mpiring import MixerSpec, Record, shard_indices
from mpiring.cost.statebytes import halo_bytes, state_bytes

from ..cli import at_least, command_parser, on_rank0, with_threads
from .peers import SHAPES, median_seconds, mixer_inputs, mixer_times
from .probes import background_cores, cpu_text, load_clock

__all__ = ["mixers", "mixers_parser", "mixer_rows", "MIXER_ROWS"]

MIXER_ROWS = [("conv", 16384), ("gdn", 4096), ("ssd", 4096), ("mamba", 2048)]
LAYOUT, PASSING = "zigzag", "allgather"


def _adapter(mixer):
    """mpiring.torch's function of ``mixer`` (taking transformers' arguments) and its state (s, a) values."""
    import mpiring.torch as mt

    s = SHAPES[mixer]
    if mixer == "conv":
        return lambda x, w, **call: mt.causal_conv1d(x, w, None, **call), None
    if mixer == "gdn":
        return (lambda *a, **call: mt.chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True, **call)[0],
                (s["Hv"] * s["dk"] * s["dv"], s["Hv"] * s["dk"] * s["dk"]))
    if mixer == "ssd":
        return (lambda x, dt, A, B, C, D, bias, **call: mt.mamba_chunk_scan(x, dt, A, B, C, D=D, dt_bias=bias,
                                                                            dt_softplus=True, **call),
                (s["H"] * s["N"] * s["P"], s["H"]))
    return (lambda x, dt, A, B, C, D, z, bias, **call: mt.selective_scan(x, dt, A, B, C, D, z, bias, True, **call),
            (s["D"] * s["N"], s["D"] * s["N"]))


def _seconds(comm, run, repeats, budget):
    """Median over repeats of the slowest rank's seconds for ``run()`` (one warm-up run first)."""
    def slowest(fn):
        comm.Barrier()
        start = time.perf_counter()
        fn()
        return comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
    return median_seconds(run, repeats, budget, slowest)


def _row(comm, mixer, S, repeats, budget):
    """This row's mpiring seconds (forward, forward+backward) and bytes (measured, modelled) of rank 0's view."""
    import torch

    size = comm.Get_size()
    mine = shard_indices(S, size, comm.Get_rank(), LAYOUT)
    args = mixer_inputs(mixer, len(mine), torch, 1 + comm.Get_rank())
    adapter, state = _adapter(mixer)
    call = dict(comm=comm, seq_len=S, layout=LAYOUT, timeout=600)
    if state is not None:
        call["passing"] = PASSING
    forward = _seconds(comm, lambda: adapter(*args, **call), repeats, budget)

    def both(record=None):
        y = adapter(*args, **call, **({} if record is None else {"record": record}))
        y.backward(torch.ones_like(y))
    total = _seconds(comm, both, repeats, budget)
    record = Record(comm.Get_rank())
    both(record)  # the forward's and the backward's bytes, counted in one record
    plan = MixerSpec.of(seq_len=S, layout=LAYOUT).plan(size)
    if state is None:
        model = [f + b for f, b in zip(*(halo_bytes(plan, SHAPES["conv"]["width"], SHAPES["conv"]["C"], 4, back)
                                         for back in (False, True)))]
    else:
        model = [f + b for f, b in zip(*(state_bytes(plan, PASSING, *state, 4, back) for back in (False, True)))]
    sent = comm.allgather(record.bytes_sent)
    return forward, total, max(sent), int(sent == model)


def _shape_text(mixer, S):
    return f"S={S} " + " ".join(f"{k}={v}" for k, v in SHAPES[mixer].items() if k != "chunk")


def mixer_rows(comm, repeats=3, budget=30.0, threads=1, rows=None):
    """Time every mixer row (``rows``: (mixer, S) pairs, default ``MIXER_ROWS``) on every rank; rank 0 prints the
    table and returns the rows (None elsewhere)."""
    import torch

    torch.set_num_threads(threads)
    rank, size = comm.Get_rank(), comm.Get_size()
    clock = load_clock(comm)
    wanted, rows = rows or MIXER_ROWS, []
    if rank == 0:
        print(format_mixer_rows([], size, threads, None), flush=True)
    for mixer, S in wanted:
        forward, total, sent, match = _row(comm, mixer, S, repeats, budget)
        peer = on_rank0(comm, lambda: mixer_times([(mixer, S)], threads=size * threads, repeats=repeats,  # noqa: B023
                                                  budget=budget)[0])
        rows.append(dict(mixer=mixer, shape=_shape_text(mixer, S), fwd_s=forward, fwdbwd_s=total,
                         torch_fwd_s=peer[0] if peer else None, torch_fwdbwd_s=peer[1] if peer else None,
                         bytes=sent, bytes_match=match))
        if rank == 0:
            print("\n".join(format_mixer_rows(rows[-1:], size, threads, None).splitlines()[3:]), flush=True)
    load = background_cores(comm, clock)
    if rank != 0:
        return None
    print("\n" + format_mixer_rows(rows, size, threads, load))
    return rows


def format_mixer_rows(rows, size, threads, load):
    """The table: one line per mixer and pass, with the CPU, the peer and the machine's load in the header."""
    import torch
    import transformers

    lines = [f"sequence mixers: {cpu_text()}; mpiring P={size} x {threads} thread, "
             f"{LAYOUT}, passing={PASSING}; peer: transformers {transformers.__version__} CPU code, 1 process x "
             f"{size * threads} threads (torch {torch.__version__}); float32, batch 1",
             "" if load is None else f"other processes kept {load:.2f} cores busy during these rows"
             + (" -- timings under load, rerun on an idle machine" if load > 0.1 else ""),
             f"{'mixer':<6} {'shape':<32} {'pass':<8} {'mpiring s':>9} {'torch s':>8} {'x torch':>7} "
             f"{'bytes/rank':>10} {'= model':>7}"]
    for row in rows:
        for name, ours, theirs in (("fwd", row["fwd_s"], row["torch_fwd_s"]),
                                   ("fwd+bwd", row["fwdbwd_s"], row["torch_fwdbwd_s"])):
            peer = f"{theirs:>8.3f} {theirs / ours:>7.2f}" if theirs else f"{'failed':>8} {'':>7}"
            lines.append(f"{row['mixer']:<6} {row['shape']:<32} {name:<8} {ours:>9.3f} {peer} "
                         f"{row['bytes']:>10} {'yes' if row['bytes_match'] else 'NO':>7}")
    return "\n".join(lines)


def mixers_parser():
    p = command_parser("bench mixers", mixers)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (median reported)")
    p.add_argument("--budget", type=float, default=30.0, help="seconds per row before repeats stop (>= 1 run)")
    p.add_argument("--threads", type=int, default=1, help="BLAS and torch threads per rank (the peer gets P times)")
    p.checks.append(at_least(1, **{"--repeats": "repeats", "--threads": "threads"}))
    return p


@with_threads(mixers_parser, user_api="blas")
def mixers(comm, args):
    """Time the sequence mixers on every rank against transformers' CPU code; rank 0 prints the rows."""
    mixer_rows(comm, repeats=args.repeats, budget=args.budget, threads=args.threads)
    return 0
