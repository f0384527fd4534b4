"""The ``run`` command: ring attention on seeded inputs under mpiexec, verified on every rank, reported on rank 0.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal --layout zigzag
    mpiexec -n 4 python -m mpiring run --causal --backward
    mpiexec -n 4 python -m mpiring run --causal --trace trace.json --plot timeline.png

Every rank makes its own shard from the seed (``tools.verify.Inputs``: no
scatter), runs ``ring_attention`` (and ``ring_attention_backward``), then
checks rows of its own shard against an exact float64 computation of its own
(``tools.verify``: built from the definitions, never from the plan or the
masks under test). Rank 0 gathers what the ranks recorded and checked, and
prints the report.
"""

import argparse
import importlib.util
import os

from mpiring import (
    MODES,
    Spec,
    predicted_backward_bytes,
    predicted_bytes_sent,
    ring_attention,
    ring_attention_backward,
    ring_attention_context_parallel,
)
from mpiring.core.precision import ACCUMULATE, GRAD_WIRE_DTYPES, INPUT_DTYPES, WIRE_DTYPES, Precision, named_dtype
from mpiring.core.record import Record
from mpiring.cost.nodes import predicted_bytes
from mpiring.cost.plantext import compute_table
from mpiring.plans.heads import HEAD_MODES, HybridPlan, sequence_pairs
from mpiring.plans.layouts import layout_positions
from mpiring.plans.plan import Schedule

from . import verify
from .calibrate import calibrate
from .cli import (
    Agreed,
    add_score_args,
    add_variant_args,
    at_least,
    balance_table,
    command_parser,
    heads_problem,
    held_positions,
    mode_text,
    objects,
    score_options,
    variant,
    with_threads,
)
from .cli_mixers import add_mixer_args, run_mixer
from .cli_plan import held_text
from .links import LinkMeter
from .plot import plot_timeline
from .progress import Progress
from .trace import format_timeline, timing_report, write_chrome_trace

__all__ = ["run", "run_parser", "job_problem"]


def _timeout(text):
    """``--timeout``: "auto", or seconds (0 = wait forever)."""
    if text == "auto":
        return text
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"'auto', a number of seconds, or 0 (wait forever); got {text!r}")
    return seconds


def run_parser():
    p = command_parser("run", run)
    p.add_argument("--seq-len", type=int, default=4096, help="tokens of the whole sequence")
    p.add_argument("--dim", type=int, default=64, help="head dim")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, help="K/V heads (grouped-query attention); default = heads")
    p.add_argument("--batch", type=int, default=1, help="batch size")
    p.add_argument("--dtype", default="float32", choices=INPUT_DTYPES,
                   help="dtype of Q, K, V (half ones compute in float32; bfloat16 needs ml_dtypes)")
    p.add_argument("--wire-dtype", choices=WIRE_DTYPES, help="K/V travel coded so (int8 and FP8: with a float32 "
                   "scale per token and head; FP8 and bfloat16 need ml_dtypes); default: the input dtype")
    p.add_argument("--grad-wire-dtype", choices=GRAD_WIRE_DTYPES, help="dtype of the travelling dK/dV partials "
                   "(--backward); default float32, float64 for float64 inputs")
    p.add_argument("--accumulate", choices=ACCUMULATE, default="float64",
                   help="dtype of the running (out, lse) every block merges into ('input': out in the input dtype)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (each rank makes its own shard)")
    p.add_argument("--threads", type=int, default=1, help="BLAS threads per rank")
    p.add_argument("--timeout", type=_timeout, default="auto", metavar="auto|SECONDS",
                   help="how long a rank waits for the others before the job ends: 'auto' (the library's: 60 s "
                        "to arrive, then 60 s + the busiest rank's FLOPs at 1e8 FLOP/s per wait), seconds, "
                        "or 0 = forever")
    p.add_argument("--no-verify", action="store_true", help="skip comparing the results (the schedule and the "
                   "bytes sent are still checked)")
    p.add_argument("--backward", action="store_true", help="also run the backward pass and verify the gradients")
    add_score_args(p)
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in ui.perfetto.dev or chrome://tracing)")
    p.add_argument("--plot", metavar="FILE", help="draw a timeline (Gantt chart) PNG; needs matplotlib")
    p.add_argument("--progress", choices=["auto", "on", "off"], default="auto",
                   help="ring step counter on rank 0 (auto: when output is a terminal)")
    add_variant_args(p)
    add_mixer_args(p)
    p.checks += [at_least(1, **{"--seq-len": "seq_len", "--dim": "dim", "--heads": "heads", "--width": "width",
                                "--state": "state",
                                "--kv-heads": "kv_heads", "--batch": "batch", "--threads": "threads",
                                "--ulysses-size": "ulysses_size"}),
                 at_least(0, **{"--seed": "seed"}), heads_problem]
    return p


def _writable(option, path):
    """None if ``path`` can be written (its directory exists and is writable), else why not."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{option} {path}: directory {folder} does not exist"
    if not os.access(folder, os.W_OK):
        return f"{option} {path}: directory {folder} is not writable"
    return None


def job_problem(args, size):
    """What is wrong with the options for a job of ``size`` ranks, or None (rank 0 decides, before the run)."""
    for name in {args.dtype, args.wire_dtype} & {"bfloat16"}:
        try:
            named_dtype(name)
        except ValueError as exc:
            return f"--dtype/--wire-dtype {name}: {exc}"
    if args.seq_len < size:
        return (f"--seq-len {args.seq_len} is shorter than the number of ranks {size}: "
                f"every rank needs at least one token")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return '--plot needs matplotlib, which is not installed: pip install -e ".[plot]" (or leave out --plot)'
    for option, path in (("--trace", args.trace), ("--plot", args.plot)):
        if path and _writable(option, path):
            return _writable(option, path)
    if not args.balance:
        return verify.check_partition(args.seq_len, size, args.layout)
    try:  # a bad --cu-seqlens, ...
        held_positions(args, args.seq_len, size)
    except ValueError as exc:
        return str(exc)
    return None


@with_threads(run_parser)
def run(comm, args):
    """Every rank makes its seeded shard and runs ring attention; every rank checks its rows; rank 0 reports."""
    rank, size = comm.Get_rank(), comm.Get_size()
    problem = objects(comm, job_problem(args, size) if rank == 0 else None)[0]  # rank 0 decides
    if problem:
        raise Agreed(problem)
    if args.mixer:
        return run_mixer(comm, args)
    dtype = named_dtype(args.dtype)
    hk = args.kv_heads or args.heads
    options = variant(args)
    inputs = verify.Inputs(args.seed, args.batch, args.heads, hk, args.dim, dtype)
    parts = held_positions(args, args.seq_len, size)  # --balance, --frames: explicit positions
    parts = parts or layout_positions(args.seq_len, size, args.layout)  # the layout's, in every mode
    positions = parts[rank]
    if args.balance:
        options["positions"] = positions
    q, k, v = (inputs.tokens(kind, positions) for kind in ("q", "k", "v"))
    timeout = None if args.timeout == 0 else args.timeout
    progress = Progress("ring step (rank 0)", enabled={"auto": None, "on": True, "off": False}[args.progress])
    forward = Record(rank, on_step=progress if rank == 0 and not args.backward else None)
    got, meter, sent = {}, LinkMeter(comm), []  # sent: each node's bytes on its links, per call
    try:  # bad arguments: the library raises the same ValueError on every rank, before any transfer
        spec = Spec.of(**options, wire_dtype=args.wire_dtype, grad_wire_dtype=args.grad_wire_dtype,
                       accumulate=args.accumulate, **score_options(args))  # one spec for both calls

        meter.start()
        got["out"], got["lse"] = ring_attention(q, k, v, comm, timeout=timeout, record=forward, spec=spec)
        sent.append(meter.stop())
        if args.backward:
            backward = Record(rank)
            dout = inputs.tokens("dout", positions)
            meter.start()
            grads = ring_attention_backward(dout, q, k, v, got["out"], got["lse"], comm, timeout=timeout,
                                            record=backward, spec=spec)
            got.update(zip(("dq", "dk", "dv", "dsinks"), grads))
            sent.append(meter.stop())
    except ValueError as exc:
        raise Agreed(str(exc)) from exc
    progress.close()
    plan = forward.plan
    machine = None
    if not args.backward:
        n_local = args.seq_len // size
        machine = calibrate(comm, head_dim=args.dim, dtype=Precision(dtype).compute.name,
                            tokens=max(16, min(n_local, 1024)), seconds=0.2, threads=args.threads,
                            nbytes=min(max(2 * args.batch * hk * n_local * args.dim * dtype.itemsize, 1 << 16),
                                       1 << 26))
    checked = None
    if not args.no_verify:
        mask = dict(causal=args.causal, window=args.window, cu_seqlens=args.cu_seqlens, causal_block=args.causal_block,
                    mask=args.mask_pieces)
        checked = verify.check_rank(inputs, args.seq_len, size, rank, parts, mask, got,
                                    share=lambda piece: objects(comm, piece),
                                    scores=verify.Scores(**score_options(args)))
    rec = backward if args.backward else forward
    if checked is not None:
        rec.error = forward.error = dict(checked["error"])  # what every rank's results were off by
    summary = dict(rec.summary(), **({"forward": forward.summary()} if args.backward else {}))
    columns = objects(comm, (rec.table(plan.n_steps), summary, checked), root=0)
    if rank != 0:
        return 0
    table = [[columns[r][0][step] for r in range(size)] for step in range(plan.n_steps)]
    sched = Schedule(table, records=[c[1] for c in columns], plan=plan)
    meter.label(sched.records)  # which link each transfer used, in the trace too
    checks = None if args.no_verify else [c[2] for c in columns]
    links = meter.report(sent[-1], plan, _shape(args), dtype.itemsize, backward=args.backward, **_wires(args))
    if args.backward:
        return _report_backward(args, sched, checks, links)
    return _report_forward(args, sched, checks, machine, links)


def _report_forward(args, sched, checks, machine, links=()):
    """Rank 0's report of a forward run; its exit code."""
    plan, records = sched.plan, sched.records
    size, dtype = plan.size, named_dtype(args.dtype)
    hk = args.kv_heads or args.heads
    wall = max(r["wall_time"] for r in records)
    flops = 4 * args.batch * args.heads * args.dim * sequence_pairs(plan)
    itemsize = dtype.itemsize
    pr, kv_width, wire_size = _wire(args)
    predicted = _predicted(args, plan)
    _head(args, sched, "mpiring run", "schedule as recorded by the ranks")
    for r, rec in enumerate(records):
        rec["blocks_computed"] = sum(t.kind != "skip" for row in sched.table for t in row[r])
    print(compute_table(plan, records))
    if args.balance or args.frames:
        print(balance_table(args, args.seq_len, size))
    schedule_failed = _schedule_failures(sched) + _pairs_failures(plan, records)
    print(f"recorded schedule equals the plan: {'NO' if schedule_failed else 'yes'}")
    print("\nrank  bytes sent  predicted  messages  compute s  blocked in wait s")
    for r, rec in enumerate(records):
        print(f"{r:>4}  {rec['bytes_sent']:>10}  {predicted[r]:>9}  {rec['messages']:>8}  "
              f"{rec['compute_time']:>9.4f}  {rec['wait_time']:>17.4f}")
    if args.seq_len % size == 0 and plan.mode in ("ring", "allgather"):
        report = ring_attention_context_parallel(args.seq_len, size, hk * args.dim, args.heads, itemsize)
        print(f"cost report: total_comm_bytes per rank x batch = {report['total_comm_bytes'] * args.batch}"
              f" (full ring; windows/documents may stop it early)")
    for line in links:
        print(line)
    print(f"\nwall time {wall:.4f} s   attention {flops / wall / 1e9:.2f} GFLOP/s "
          f"(4*B*H*D*visible pairs = {flops / 1e9:.3f} GFLOP)")
    failed = schedule_failed + _count_failures("bytes sent", [r["bytes_sent"] for r in records], predicted)
    failed += verify.print_checks(checks, dtype, pr.wire.name)
    print()
    per_element = kv_width * wire_size / (args.batch * hk * 2 * args.dim)  # an int8 wire's scales included
    print(timing_report(records, plan, machine, batch=args.batch, heads=args.heads, kv_heads=hk, head_dim=args.dim,
                        itemsize=per_element, ranks_per_core=size * args.threads / (os.cpu_count() or 1)))
    print("\ntimeline (text; --plot FILE draws it, --trace FILE for Perfetto):")
    print(format_timeline(records))
    _write_trace_and_plot(args, records, f"P={size} {plan.layout} {plan.mode}{' causal' if plan.causal else ''}, "
                          f"seq_len={args.seq_len}, H={args.heads} d={args.dim} {dtype}")
    return _verdict(failed, checks)


def _head(args, sched, title, what):
    """A report's first lines: the problem, the wires, the schedule the ranks recorded."""
    plan = sched.plan
    print(f"{title}: P={plan.size} seq_len={args.seq_len} batch={args.batch} heads={args.heads} "
          f"kv_heads={args.kv_heads or args.heads} dim={args.dim} {named_dtype(args.dtype)} causal={plan.causal} "
          f"{held_text(args, plan)} mode={mode_text(plan)} window={plan.window}")
    print(_wire_line(args, _wire(args)[0]))
    print(f"\n{what}:")
    print(sched.format())


def _shape(args):
    """The problem's shape as ``heads.predicted_bytes`` takes it."""
    return dict(batch=args.batch, hq=args.heads, hk=args.kv_heads or args.heads, dim=args.dim, dim_v=args.dim)


def _predicted(args, plan, backward=False):
    """Bytes each rank sends, K/V on the run's wire and the partials in its gradient dtype: ring modes as the
    cost model counts them, other modes as mpiring.cost.nodes does."""
    pr, kv_width, wire_size = _wire(args)
    if plan.mode not in MODES or isinstance(plan, HybridPlan):  # the flat ring modes: the cost model's own bytes
        return predicted_bytes(plan, **_shape(args), itemsize=named_dtype(args.dtype).itemsize, backward=backward,
                               **_wires(args))
    if not backward:
        return predicted_bytes_sent(plan, kv_width, wire_size)
    hk = args.kv_heads or args.heads
    return predicted_backward_bytes(plan, kv_width, wire_size, pr.grad.itemsize, args.batch * hk * 2 * args.dim)


def _wires(args):
    """What ``nodes.traffic`` takes of the run's wires: the K/V wire's name, the gradients' bytes."""
    return dict(wire_dtype=args.wire_dtype, grad_itemsize=_wire(args)[0].grad.itemsize)


def _wire(args):
    """The run's ``Precision``, and what a token of K plus V is on the wire: (elements, bytes per element)."""
    pr = Precision(named_dtype(args.dtype), args.wire_dtype, args.grad_wire_dtype, args.accumulate)
    return pr, args.batch * (args.kv_heads or args.heads) * 2 * pr.wire.row(args.dim), pr.wire.dtype.itemsize


def _wire_line(args, pr):
    """What travels and what accumulates, in one line; with the wire's size against float32 K/V."""
    row = pr.wire.row(args.dim) * pr.wire.dtype.itemsize
    scales = " (+ a float32 scale per token and head)" if pr.wire.scaled else ""
    line = (f"K/V on the wire: {pr.wire.name}{scales}, {row / (4 * args.dim):.3g}x the bytes of float32; "
            f"running (out, lse): {pr.out}, {pr.lse}")
    if args.backward:
        line += f"; dK/dV partials on the wire: {pr.grad}"
    return line


def _schedule_failures(sched):
    """What differs between the schedule the ranks recorded and the plan: the first differing step of each rank."""
    plan = sched.plan
    if sched == plan.schedule:
        return []
    if sched.n_steps != plan.n_steps:
        return [f"schedule: the ranks recorded {sched.n_steps} steps, the plan has {plan.n_steps}"]
    out = []
    for r in range(plan.size):
        for step in range(plan.n_steps):
            ran, planned = sched.table[step][r], plan.tasks(step, r)
            if ran != planned:
                out.append(f"schedule: rank {r} at step {step} ran {_tasks_text(ran)}, the plan says "
                           f"{_tasks_text(planned)}")
                break
    return out


def _tasks_text(tasks):
    return "[" + ", ".join(f"block of rank {t.source} ({t.kind})" for t in tasks) + "]"


def _pairs_failures(plan, records):
    return _count_failures("visible (query, key) pairs", [r["visible_pairs"] for r in records], plan.visible_pairs())


def _count_failures(what, measured, predicted):
    """A line for every rank whose measured count is not the predicted one."""
    return [f"{what}: rank {r} measured {m}, predicted {p}"
            for r, (m, p) in enumerate(zip(measured, predicted, strict=True)) if m != p]


def _verdict(failed, checks):
    """The last lines: what failed, each on its own line, then VERIFIED only when results were compared and
    nothing failed; the exit code."""
    for line in failed:
        print(f"FAILED {line}")
    if checks is None:
        if not failed:
            print("NOT VERIFIED (--no-verify): the schedule and the bytes sent were checked, the results were not "
                  "compared")
            return 0
        print(f"VERIFICATION FAILED ({len(failed)} check(s) above; results not compared: --no-verify)")
        return 1
    if failed:
        print(f"VERIFICATION FAILED ({len(failed)} check(s) above)")
        return 1
    if "dQ" in checks[0]["error"] and "dK" not in checks[0]["error"]:
        print("VERIFIED out, lse and dQ on sampled rows; dK and dV NOT CHECKED (see above)")
    else:
        print("VERIFIED")
    return 0


def _write_trace_and_plot(args, records, title):
    """``run --trace FILE`` and ``--plot FILE`` on rank 0."""
    if args.trace:
        write_chrome_trace(args.trace, records, title=title)
        print(f"trace written to {args.trace} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if args.plot:
        size, cores = len(records), os.cpu_count() or 1
        shared = size * args.threads > cores
        note = f"{size} ranks on {cores} cores share them: times are not meaningful" if shared else None
        plot_timeline(records, args.plot, title=title, note=note)  # matplotlib: checked before the run
        print(f"timeline written to {args.plot}")


def _report_backward(args, sched, checks, links=()):
    """Rank 0's report of ``run --backward``; its exit code."""
    plan, records = sched.plan, sched.records
    size, dtype = plan.size, named_dtype(args.dtype)
    pr = _wire(args)[0]
    fwd_bytes, bwd_bytes = _predicted(args, plan), _predicted(args, plan, backward=True)
    bwd_messages = [plan.messages_of(r, backward=True) for r in range(size)]
    _head(args, sched, "mpiring run --backward", "backward schedule as recorded by the ranks (K/V and their dK/dV "
          "partials follow the forward plan)")
    schedule_failed = _schedule_failures(sched)
    print(f"recorded schedule equals the plan: {'NO' if schedule_failed else 'yes'}")
    print("\n      forward               backward")
    print("rank  bytes sent  predicted  bytes sent   predicted  messages  predicted  compute s  blocked in wait s")
    for r, rec in enumerate(records):
        print(f"{r:>4}  {rec['forward']['bytes_sent']:>10}  {fwd_bytes[r]:>9}  {rec['bytes_sent']:>10}  "
              f"{bwd_bytes[r]:>10}  {rec['messages']:>8}  {bwd_messages[r]:>9}  {rec['compute_time']:>9.4f}  "
              f"{rec['wait_time']:>17.4f}")
    all_to_all = plan.mode in HEAD_MODES or isinstance(plan, HybridPlan)
    back = " and the dQ, dK, dV the all-to-all brings back" if all_to_all else ""
    print(f"(backward bytes: K/V as on the forward's wire, {pr.wire.name}; their travelling dK/dV partials{back} "
          f"in {pr.grad})")
    flops = 4 * args.batch * args.heads * args.dim * sequence_pairs(plan)
    for name, wall, factor in (("forward ", max(r["forward"]["wall_time"] for r in records), 1.0),
                               ("backward", max(r["wall_time"] for r in records), 2.5)):
        print(f"{name} wall time {wall:.4f} s   {factor * flops / wall / 1e9:.2f} GFLOP/s "
              f"({factor * flops / 1e9:.3f} GFLOP)")
    print("FLOPs: forward 4*B*H*D*visible pairs; backward 2.5x forward, as FlashAttention counts")
    for line in links:
        print(line)
    failed = (schedule_failed
              + _count_failures("forward bytes sent", [r["forward"]["bytes_sent"] for r in records], fwd_bytes)
              + _count_failures("backward bytes sent", [r["bytes_sent"] for r in records], bwd_bytes)
              + _count_failures("backward messages", [r["messages"] for r in records], bwd_messages))
    failed += verify.print_checks(checks, dtype, pr.wire.name)
    _write_trace_and_plot(args, records, f"backward pass: P={size} {plan.layout} {plan.mode}"
                          f"{' causal' if plan.causal else ''}, seq_len={args.seq_len}, H={args.heads} d={args.dim}")
    return _verdict(failed, checks)
