"""``bench mixers``: the sequence mixers on P ranks against transformers' CPU code in one process.

    mpiexec -n 2 python -m mpiring bench mixers          # the rows of docs/performance.md section 18

Each row times one mixer through ``mpiring.torch`` (the same pointwise steps
as transformers' layer, the recurrence or convolution through mpiring),
forward and forward+backward, on P ranks x 1 thread with zigzag shards and
the all-gather of states; then, in the same run, transformers' own function
on the whole sequence in one process with P threads (``peers``, a
child process while the ranks idle). Wall: the slowest rank's, median of
the repeats. "x torch": torch's seconds over mpiring's (above 1: mpiring is
faster). Bytes: the most any rank sent (forward + backward), against the
byte model (``mpiring.cost.statebytes``). Float32, batch 1.
"""

import statistics
import time

from mpi4py import MPI

from mpiring import MixerSpec, Record, shard_indices
from mpiring.cost.statebytes import halo_bytes, state_bytes

from ..cli import at_least, command_parser, with_threads
from .peers import SHAPES, mixer_times
from .probes import busy_cpu_seconds, cpu_text, own_cpu_seconds

__all__ = ["mixers", "mixers_parser", "mixer_rows", "MIXER_ROWS"]

MIXER_ROWS = [("conv", 16384), ("gdn", 4096), ("ssd", 4096), ("mamba", 2048)]
LAYOUT, PASSING = "zigzag", "allgather"


def _inputs(mixer, S, mine, torch):
    """This rank's shard of the row's float32 inputs (requiring grad), the adapter, and its state (s, a) values."""
    import mpiring.torch as mt

    g = torch.Generator().manual_seed(1 + MPI.COMM_WORLD.Get_rank())
    n, shape = len(mine), SHAPES[mixer]

    def t(*size, scale=1.0, low=False):
        x = torch.rand(*size, generator=g) if low else torch.randn(*size, generator=g)
        return (x * scale).requires_grad_()

    if mixer == "conv":
        return [t(1, shape["C"], n), t(shape["C"], shape["width"])], \
            lambda x, w, **call: mt.causal_conv1d(x, w, None, **call), None
    if mixer == "gdn":
        Hk, Hv, dk, dv = shape["Hk"], shape["Hv"], shape["dk"], shape["dv"]
        args = [t(1, n, Hk, dk), t(1, n, Hk, dk), t(1, n, Hv, dv), t(1, n, Hv, scale=-0.1, low=True),
                t(1, n, Hv, low=True)]
        return args, lambda *a, **call: mt.chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True, **call)[0], \
            (Hv * dk * dv, Hv * dk * dk)
    if mixer == "ssd":
        H, P, G, N = shape["H"], shape["P"], shape["G"], shape["N"]
        args = [t(1, n, H, P), t(1, n, H), t(H, scale=-1.0, low=True), t(1, n, G, N), t(1, n, G, N), t(H), t(H)]
        return args, lambda x, dt, A, B, C, D, bias, **call: mt.mamba_chunk_scan(
            x, dt, A, B, C, D=D, dt_bias=bias, dt_softplus=True, **call), (H * N * P, H)
    D, N = shape["D"], shape["N"]
    args = [t(1, D, n), t(1, D, n), t(D, N, scale=-1.0, low=True), t(1, N, n), t(1, N, n), t(D), t(1, D, n), t(D)]
    return args, lambda x, dt, A, B, C, Dd, z, bias, **call: mt.selective_scan(
        x, dt, A, B, C, Dd, z, bias, True, **call), (D * N, D * N)


def _seconds(comm, run, repeats, budget):
    """Median over repeats of the slowest rank's seconds for ``run()`` (one warm-up run first)."""
    run()
    samples, spent = [], 0.0
    while len(samples) < repeats and spent < budget:
        comm.Barrier()
        start = time.perf_counter()
        run()
        samples.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
        spent += samples[-1]
    return statistics.median(samples)


def _row(comm, mixer, S, repeats, budget):
    """This row's mpiring seconds (forward, forward+backward) and bytes (measured, modelled) of rank 0's view."""
    import torch

    size = comm.Get_size()
    mine = shard_indices(S, size, comm.Get_rank(), LAYOUT)
    args, adapter, state = _inputs(mixer, S, mine, torch)
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
    clock = (time.perf_counter(), busy_cpu_seconds(), comm.allreduce(own_cpu_seconds()))
    wanted, rows = rows or MIXER_ROWS, []
    if rank == 0:
        print(format_mixer_rows([], size, threads, None), flush=True)
    for mixer, S in wanted:
        forward, total, sent, match = _row(comm, mixer, S, repeats, budget)
        peer = None
        if rank == 0:
            peer = mixer_times([(mixer, S)], threads=size * threads, repeats=repeats, budget=budget)[0]
        request = comm.Ibarrier()  # the others sleep while rank 0's child times torch
        while not request.Test():
            time.sleep(0.01)
        rows.append(dict(mixer=mixer, shape=_shape_text(mixer, S), fwd_s=forward, fwdbwd_s=total,
                         torch_fwd_s=peer[0] if peer else None, torch_fwdbwd_s=peer[1] if peer else None,
                         bytes=sent, bytes_match=match))
        if rank == 0:
            print("\n".join(format_mixer_rows(rows[-1:], size, threads, None).splitlines()[3:]), flush=True)
    start, busy, own = clock
    own = comm.allreduce(own_cpu_seconds()) - own
    now = busy_cpu_seconds()
    load = None if busy is None or now is None else max(0.0, (now - busy - own) / (time.perf_counter() - start))
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
