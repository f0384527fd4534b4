"""The support matrix: which strategy works with which option, run for real against the float64 reference.

    mpiexec -n 4 python -m mpiring support                 # the matrix: tables on rank 0
    mpiexec -n 4 python -m mpiring support --markdown --write docs/reliability.md   # the doc's P = 4 section
    mpiexec -n 2 python -m mpiring support --full          # every cell of the product (minutes)

A cell works when every rank's result is within ``mpiring.testing``'s tolerance of the float64 reference,
or raises the same ValueError on every rank before any data moved; anything else is WRONG (exit 1).
``matrix``: per strategy, every option alone, then the options that work alone in the rows of a strength-2
covering array, then every pair of options of each failed row (docs/reliability.md section 6).
"""

import itertools
import math
import time
from typing import NamedTuple

import numpy as np

from mpiring.core.precision import INPUT_DTYPES, WIRE_DTYPES, named_dtype
from mpiring.core.record import Record
from mpiring.plans.checks import verdict
from mpiring.plans.layouts import LAYOUTS
from mpiring.plans.plan import ALL_MODES, MODES
from mpiring.testing import attention_error, tolerance

from . import support_cases as cases
from .cli import Agreed, command_parser, table_text
from .support_cases import head_counts, sizes
from .verify import run_tolerance

__all__ = ["AXES", "DEFAULTS", "Cell", "strategies", "cells", "changed", "label", "covering", "matrix", "sample",
           "run_cells", "run_case", "render", "doc_section", "write_section", "support",
           "support_parser"]

AXES = {"assignment": LAYOUTS + ("positions", "kv_positions", "cross"),  # cross: queries over another sequence
        "mask": ("none", "causal", "window", "documents", "block-causal", "top-k", "per-head"),  # top-k: an
        # indexer's choice; per-head: a function of (batch, head, q_pos, k_pos)
        "heads": ("MHA", "GQA", "MQA", "MLA", "uneven", "uneven GQA"),  # ``support_cases.head_counts``
        "dtype": INPUT_DTYPES,
        "wire": ("none",) + WIRE_DTYPES,
        "score": ("none", "softcap", "alibi", "sinks", "dropout", "score_mod", "table")}  # docs/masks.md's
DEFAULTS = {"assignment": "contiguous", "mask": "none", "heads": "MHA", "dtype": "float32", "wire": "none",
            "score": "none"}
PASSES = ("forward", "backward")


class Cell(NamedTuple):
    """One combination of the axes; ``pass_`` is "forward" or "backward"."""

    strategy: str
    assignment: str
    mask: str
    heads: str
    dtype: str
    wire: str
    score: str
    pass_: str


# ---------------------------------------------------------------- the axes and the cells


def strategies(P):
    """Every strategy at P ranks, name -> its ``ring_attention`` options: every movement of K/V (ring modes,
    Ulysses, double ring with ``node_size`` n, grid of ``ulysses_size`` u), then each with ``rotate="q"``."""
    found = {mode: {"mode": mode} for mode in MODES}
    for mode in ALL_MODES:
        if mode == "double_ring":  # one rank per node, two nodes (or P // 2 ranks each), one node
            for n in sorted({n for n in (1, P // 2, P) if n >= 1 and P % n == 0}):
                found[f"double_ring n={n}"] = {"mode": mode, "node_size": n}
        elif mode not in MODES:
            found[mode] = {"mode": mode}
    for u in sorted({u for u in (2, P) if u > 1 and P % u == 0}):  # Ulysses in groups of u, a ring mode across
        for mode in MODES:
            found[f"grid u={u} {mode}"] = {"mode": mode, "ulysses_size": u}
    passing_q = {("pass-Q" if name == "ring" else f"pass-Q {name}"): dict(options, rotate="q")
                 for name, options in found.items()}
    return {**found, **passing_q}


def cells(P):
    """The full product of the axes at P ranks, in a fixed order."""
    return [Cell(s, *rest, p) for s in strategies(P) for rest in itertools.product(*AXES.values()) for p in PASSES]


def changed(cell):
    """The options ``cell`` sets beside its strategy and pass: ``(axis, value)`` of every axis off its default."""
    return tuple((axis, value) for axis, value in zip(DEFAULTS, cell[1:-1]) if value != DEFAULTS[axis])


def label(cell):
    """``cell``'s options as text: "zigzag + float16", or "defaults"."""
    return " + ".join(value for _, value in changed(cell)) or "defaults"


def _cell(strategy, options, pass_):
    """The cell of ``strategy`` with ``options`` (``(axis, value)`` pairs), the other axes at their defaults."""
    values = dict(DEFAULTS, **dict(options))
    return Cell(strategy, *(values[axis] for axis in DEFAULTS), pass_)


def covering(levels):
    """Rows over the value lists ``levels`` in which every pair of values of any two lists meets: rows (i, j) over
    Z_p (p prime, >= every list), columns i, j, i + j, i + 2j, ... mod p, each taken mod its list's length."""
    p = next(p for p in (2, 3, 5, 7, 11, 13) if p >= max(map(len, levels)) and p + 1 >= len(levels))
    rows = {}
    for i, j in itertools.product(range(p), repeat=2):
        columns = [i, j] + [(i + m * j) % p for m in range(1, len(levels) - 1)]
        rows[tuple(values[c % len(values)] for values, c in zip(levels, columns))] = None
    return list(rows)


def sample(P, n, seed=0, most=None):
    """``n`` cases of the full product drawn with ``seed``, the strategies in turn, forward and backward each;
    ``most``: only cases with at most that many options off their defaults."""
    rng = np.random.default_rng(seed)
    names = list(strategies(P))
    rest = [c for c in itertools.product(*AXES.values())
            if most is None or sum(v != d for v, d in zip(c, DEFAULTS.values())) <= most]
    picks = [(names[i % len(names)], rest[rng.integers(len(rest))]) for i in range(n)]
    return list({Cell(s, *case, p): None for s, case in picks for p in PASSES})


# ---------------------------------------------------------------- running cells


def _missing(names):
    """Why a dtype of ``names`` cannot be made here (bfloat16 and FP8 need ml_dtypes), or None."""
    for name in names:
        try:
            named_dtype(name)
        except ValueError as exc:
            return str(exc)
    return None


def _error(name, got, want, tol, dtype):
    """``(error / tolerance, text)`` of one result against its reference; a wrong dtype or shape is infinite."""
    if got.dtype != dtype or got.shape != want.shape:
        return math.inf, f"{name} is {got.dtype} {got.shape}, not {np.dtype(dtype)} {want.shape}"
    error = attention_error(got, want, name)[0]
    return error / tol, f"{name} error {error:.3g} > tolerance {tol:g}"


def _verdict(comm, call, record, compare, keep_going):
    """``(result, verdict)`` of ``call()``, the same verdict on every rank (one all-gather); ``compare(result)``
    gives ``(name, got, want, tolerance, dtype)`` tuples. Other exceptions than ValueError propagate, or with
    ``keep_going`` are WRONG."""
    result, message, worst = None, None, (0.0, "")
    try:
        result = call()
    except ValueError as exc:
        message = str(exc)
    except Exception as exc:
        if not keep_going:
            raise
        message = f"crashed: {type(exc).__name__}: {exc}"
    if message is None:
        try:
            worst = max([_error(*c) for c in compare(result)] + [worst], key=lambda w: w[0])
        except Exception as exc:  # noqa: BLE001 (a result that cannot be compared is wrong, on this rank alone)
            worst = (math.inf, f"the result cannot be compared: {type(exc).__name__}: {exc}")
    moved = bool(record.bytes_sent or record.messages or record.events or record.tasks)
    said = comm.allgather((message, moved, worst))
    messages = [m for m, _, _ in said]
    if len(set(messages)) > 1:
        return None, "WRONG: ranks raised different errors: " + verdict([m or "returned" for m in messages])
    if message is not None:
        if message.startswith("crashed: "):
            return None, f"WRONG: {message}"
        if any(m for _, m, _ in said):
            return None, f"WRONG: raised after data moved: {message}"
        return None, f"raises: {message}"
    ratios = [w[0] for _, _, w in said]
    rank = int(np.argmax(ratios))
    return result, "works" if ratios[rank] <= 1 else f"WRONG: {said[rank][2][1]} (rank {rank})"


def run_case(comm, case, backward=True, records=None, keep_going=False):
    """``{"forward": verdict, "backward": verdict}`` of one case (a Cell without its pass), the same on every rank:
    "works", "raises: <message>", "skipped: <why>" or "WRONG: <what>". The backward runs on the forward's
    results (a forward that raises: the backward's cell too). ``records``: the two passes' ``Record``."""
    strategy, assignment, mask, heads, dtype, wire, score = case
    missing = _missing([dtype] + [wire] * (wire != "none"))
    if missing:
        return {"forward": f"skipped: {missing}", "backward": f"skipped: {missing}"}
    P, rank = comm.Get_size(), comm.Get_rank()
    mine, kv, held = cases.placement(P, rank, assignment)
    wire = None if wire == "none" else wire
    options = dict(strategies(P)[strategy], **cases.mask_options(mask, sizes(P)[0], head_counts(P, heads)[0]), **held,
                   wire_dtype=wire,
                   **cases.score_options(score, P, heads))
    whole = cases.inputs(P, heads, dtype)[0]  # q, k, v, dout (MLA: q, c_kv, k_rope, dout, w_uk, w_uv)
    arrays = [np.ascontiguousarray(a[..., rows, :]) for a, rows in zip(whole, (mine, kv, kv, mine))] + whole[4:]
    ref = cases.reference(P, heads, dtype, mask, assignment == "kv_positions", score, assignment == "cross")
    kind = named_dtype(dtype)
    lse_kind = np.float32 if kind.itemsize == 2 else kind  # half inputs: lse in float32
    fwd, bwd = records or (Record(rank), Record(rank))

    def forward_errors(result):
        return [("out", result[0], ref[0][..., mine, :], tolerance(kind, wire), kind),
                ("lse", result[1], ref[1][..., mine], tolerance(lse_kind, wire), lse_kind)]

    result, verdict = _verdict(comm, lambda: cases.call(heads)(arrays, comm, options, fwd, None), fwd, forward_errors,
                               keep_going)
    verdicts = {"forward": verdict, "backward": verdict}
    if backward and result is not None:
        codings = 2 if options.pop("rotate", None) == "q" else 1  # no pass-Q backward: K/V travel (coded too)
        at = {"q": np.s_[..., mine, :], "k": np.s_[..., kv, :], "all": np.s_[...]}

        def backward_errors(grads):
            # the weights' gradients (MLA: rows "all") in float64, as the weights; products of the coded latent and
            # gradients made from it, they carry two codings' error (bfloat16 2.0e-2, int8 3.9e-2 at P = 4)
            found = []
            for (name, rows), g, r in zip(cases.grad_names(heads), grads, ref[2:]):
                weights = rows == "all"
                found.append((name, g, r[at[rows]], run_tolerance(kind, wire, codings * (1 + weights)),
                              np.float64 if weights else kind))
            if heads != "MLA":  # sinks, a bias table: their gradients, summed over every rank's rows
                extra = cases.extra_grads(score)
                if len(grads) != 3 + len(extra):
                    raise ValueError(f"the backward returned {len(grads)} gradients; {3 + len(extra)} expected")
                for j, name in enumerate(extra):
                    found.append((name, grads[3 + j], ref[5 + j], run_tolerance(kind, wire, codings), np.float64))
            return found

        verdicts["backward"] = _verdict(comm, lambda: cases.call(heads, True)(arrays, comm, options, bwd, result), bwd,
                                        backward_errors, keep_going)[1]
    return verdicts


def run_cells(comm, chosen, keep_going=False):
    """``{cell: verdict}`` of every cell in ``chosen``; a forward and backward of one case share one run."""
    by_case = {}
    for cell in chosen:
        by_case.setdefault(cell[:-1], set()).add(cell.pass_)
    verdicts = {}
    for case, passes in by_case.items():
        got = run_case(comm, case, backward="backward" in passes, keep_going=keep_going)
        verdicts.update({Cell(*case, p): got[p] for p in passes})
    return {cell: verdicts[cell] for cell in chosen}


def matrix(comm, keep_going=False):
    """``{cell: verdict}`` of the matrix at this communicator's size (the module's docstring), in run order."""
    verdicts = {}

    def run(chosen):
        verdicts.update(run_cells(comm, [c for c in chosen if c not in verdicts], keep_going))

    def works(*options, strategy):
        return all(verdicts[_cell(strategy, options, p)] == "works" for p in PASSES)

    P = comm.Get_size()
    for s in strategies(P):
        alone = [((axis, value),) for axis, values in AXES.items() for value in values if value != DEFAULTS[axis]]
        run([_cell(s, options, p) for options in [()] + alone for p in PASSES])
        if not works(strategy=s):
            continue
        levels = [[v for v in values if works((axis, v), strategy=s)] for axis, values in AXES.items()]
        rows = [tuple(zip(AXES, row)) for row in covering(levels)]
        run([_cell(s, row, p) for row in rows for p in PASSES])
        failed = [changed(_cell(s, row, "forward")) for row in rows if not works(*row, strategy=s)]
        run([_cell(s, pair, p) for options in failed for pair in itertools.combinations(options, 2) for p in PASSES])
    return verdicts


# ---------------------------------------------------------------- the tables


def _failing_alone(verdicts, cell):
    """Does ``cell`` fail while every cell run with fewer of its options (same strategy and pass) works?"""
    options = changed(cell)
    if verdicts[cell] == "works" or verdicts[cell].startswith("skipped"):
        return False
    smaller = (_cell(cell.strategy, part, cell.pass_) for n in range(len(options))
               for part in itertools.combinations(options, n))
    return all(verdicts.get(c, "works") == "works" for c in smaller)


def render(verdicts, P, markdown=False):
    """``{cell: verdict}`` as text: per axis, strategy x value (that option alone); the combinations that
    fail although less of them works; every error in full, numbered; every WRONG cell."""
    errors = {}
    for v in verdicts.values():
        if v.startswith("raises: "):
            errors.setdefault(v[len("raises: "):], f"E{len(errors) + 1}")

    def key(v):
        if v in ("works", "-"):
            return v
        return errors.get(v[len("raises: "):]) or ("WRONG" if v.startswith("WRONG") else "skip")

    def both(strategy, options):
        keys = [key(verdicts.get(_cell(strategy, options, p), "-")) for p in PASSES]
        return keys[0] if keys[0] == keys[1] else " / ".join(keys)

    counts = {kind: sum(v.startswith(kind) for v in verdicts.values()) for kind in ("works", "raises", "WRONG",
                                                                                    "skipped")}
    names = [s for s in strategies(P) if any(c.strategy == s for c in verdicts)]
    S, D, hq = sizes(P)
    bold = "**" if markdown else ""
    out = [f"P = {P}: {len(verdicts)} cells of the {len(cells(P))} of the full product ({S} tokens, head dim {D}, "
           f"{hq} query heads; uneven {head_counts(P, 'uneven')[0]}, uneven GQA "
           f"{'/'.join(map(str, head_counts(P, 'uneven GQA')))}): {counts['works']} work, {counts['raises']} raise, "
           f"{counts['WRONG']} WRONG, {counts['skipped']} skipped.",
           "",
           f"Each option alone, the others at their defaults ({', '.join(f'{a} {v}' for a, v in DEFAULTS.items())}); "
           f"a cell is forward / backward where they differ:"]
    for axis, values in AXES.items():
        rows = [[s] + [both(s, ((axis, value),)) for value in values] for s in names]
        out += ["", f"{bold}{axis}{bold}", "", table_text(["strategy"] + list(values), rows, markdown, left=True)]
    minimal = [cell for cell in verdicts if _failing_alone(verdicts, cell)]
    together = {(cell.strategy, changed(cell)): None for cell in minimal if len(changed(cell)) > 1}
    out += ["", f"{bold}options that fail together{bold} (each works alone, or with fewer of them):", ""]
    rows = [[s, label(_cell(s, options, "forward")), *(key(verdicts.get(_cell(s, options, p), "-")) for p in PASSES)]
            for s, options in together]
    out.append(table_text(["strategy", "options", *PASSES], rows, markdown, left=True) if rows else "none")
    if errors:
        out += ["", f"{bold}errors{bold}", ""] + [f"- {number}: `{message}`" if markdown else f"{number}: {message}"
                                                  for message, number in errors.items()]
    wrong = {}  # the WRONG cells of the tables above, alike ones together
    for cell in minimal:
        if verdicts[cell].startswith("WRONG"):
            what = f"{label(cell)}, {cell.pass_}: {verdicts[cell]}"
            wrong.setdefault(what, []).append(cell.strategy)
    if wrong:
        more = counts["WRONG"] - sum(map(len, wrong.values()))
        out += ["", f"{bold}WRONG{bold}{f' (and {more} more cells with these options and others)' if more else ''}",
                ""] + [f"{'- ' if markdown else ''}{', '.join(who)}; {what}" for what, who in wrong.items()]
    return "\n".join(out)


def _markers(P):
    return f"<!-- support matrix P={P}: begin -->", f"<!-- support matrix P={P}: end -->"


def doc_section(text, P):
    """What ``text`` (a doc) holds between the markers of the P-rank matrix, stripped; None without markers."""
    begin, end = _markers(P)
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip()


def write_section(path, P, table):
    """Put ``table`` between the P-rank markers of the file at ``path``."""
    with open(path) as f:
        head, rest = f.read().split(_markers(P)[0], 1)
    with open(path, "w") as f:
        f.write(f"{head}{_markers(P)[0]}\n{table}\n{_markers(P)[1]}{rest.split(_markers(P)[1], 1)[1]}")


def _write_problem(args, P):
    """Why ``--write`` cannot write (every rank finds the same), or None."""
    if args.full or args.sample:
        return "--write takes the matrix, not --full or --sample"
    try:
        with open(args.write) as f:
            found = doc_section(f.read(), P) is not None
    except OSError as exc:
        return f"--write: {exc}"
    return None if found else f"{args.write} has no markers {' and '.join(_markers(P))}"


# ---------------------------------------------------------------- the command


def support_parser():
    p = command_parser("support", support)
    p.add_argument("--markdown", action="store_true", help="markdown tables (as docs/reliability.md holds them)")
    p.add_argument("--full", action="store_true", help="every cell of the product (minutes)")
    p.add_argument("--sample", type=int, metavar="N", help="N cases of the product drawn with --seed, forward "
                   "and backward each, instead of the matrix")
    p.add_argument("--seed", type=int, default=0, help="the sample's seed")
    p.add_argument("--stop", action="store_true", help="let an exception other than ValueError end the run "
                   "(by default it is a WRONG cell and the run goes on)")
    p.add_argument("--write", metavar="PATH", help="also put the markdown tables between this P's markers in PATH")
    return p


def support(comm, args=None):
    """Run strategy x option combinations against the float64 reference: works, or the error raised."""
    args = support_parser().parse_args(args)
    P, start = comm.Get_size(), time.perf_counter()
    problem = args.write and _write_problem(args, P)
    if problem:
        raise Agreed(problem)
    if args.sample or args.full:
        verdicts = run_cells(comm, sample(P, args.sample, args.seed) if args.sample else cells(P), not args.stop)
    else:
        verdicts = matrix(comm, not args.stop)
    seconds = time.perf_counter() - start
    if comm.Get_rank() == 0:
        print(render(verdicts, P, args.markdown))
        if not args.markdown:
            print(f"\n{len(verdicts) // 2} runs in {seconds:.1f} s")
        if args.write:
            write_section(args.write, P, render(verdicts, P, True))
    return 1 if any(v.startswith("WRONG") for v in verdicts.values()) else 0
