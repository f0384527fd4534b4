"""The command line of mpiring: a registry of commands, each a function ``(comm, args=None) -> exit code``.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal
    python -m mpiring schedule -P 4 --layout zigzag --causal
    mpiexec -n 4 python -m mpiring run --causal --trace trace.json --plot timeline.png   # see the ring
    python -m mpiring cost --seq-len 1048576 -P 8 --hidden 4096 --heads 32 --causal    # + time model
    mpiexec -n 4 python -m mpiring generate --prompt-len 4096 --new-tokens 16 --heads 8 --kv-heads 2
    mpiexec -n 2 python -m mpiring bench --quick        # the benchmark table (run/bench runs -n 1 and -n 2)
    python -m mpiring bench tune                        # fastest GEMM backend and tiles here, cached
    python -m mpiring bench percore                     # one core: the kernel, its parts, the limit, torch
    mpiexec -n 4 python -m mpiring support              # which strategy works with which option (docs/reliability.md)
    mpiexec -n 4 python -m mpiring grade student.py     # grade a student's ring (docs/exercises.md)
    python -m mpiring grade class/ --ranks 2,3,4 --report report.json  # a class, at several P (docs/course.md)
    mpiexec -n 2 python -m mpiring demo deadlock        # a blocking ring deadlocks; the two fixes

Every command lives in ``mpiring.tools``, owns its parser (``<command>_parser()``)
and prints on rank 0 only. Commands that need no MPI get ``comm=None`` and never
import mpi4py; the others get ``MPI.COMM_WORLD``, and every rank leaves with rank 0's exit code.

How a job ends under mpiexec:

- bad options (argparse's usage and errors, ``--help``): answered before MPI
  starts, printed by rank 0 only, exit 2 (``--help``: 0) on every rank;
- an error every rank finds alike (``tools.cli.Agreed``: an option that does
  not fit the job, the library's agreed ValueError): printed once by rank 0,
  every rank exits 2, no abort;
- an exception or a ``sys.exit`` on one rank: that rank prints it and aborts
  the job (``MPI_Abort``), so nobody waits for it forever;
- Ctrl-C (SIGINT, which mpiexec passes to every rank): rank 0 prints
  ``interrupted``, every rank exits 130 at once, no traceback; once the
  command is over (its verdict out), a Ctrl-C is ignored while the ranks leave.
"""

import argparse
import contextlib
import ctypes
import importlib
import os
import signal
import sys
import threading
import time
import traceback

from mpiring.tools.cli import Agreed, launch_rank, poll

# command: (module in mpiring.tools, needs MPI, what it does)
COMMANDS = {
    "run": ("cli_run", True, "run ring attention under mpiexec and verify it"),
    "generate": ("cli_generate", True, "prefill a KV cache sharded over the ranks, decode token by token, verified"),
    "schedule": ("cli_plan", False, "print the ring schedule (no MPI needed)"),
    "cost": ("cli_plan", False, "the analytical cost report, then the time model (no MPI needed)"),
    "bench": ("bench", True, "the benchmark table; 'bench SUBCOMMAND': percore, tune, plan, accuracy, zoo, ... "
              "(see 'bench --help')"),
    "support": ("support", True, "every strategy x option against the float64 reference: works, or its error"),
    "grade": ("grade", True, "grade a student's ring attention (docs/exercises.md)"),
    "demo": ("deadlock", True, "demonstrations: 'demo deadlock' shows a blocking ring deadlock and its fixes"),
}

# commands of an earlier release, now subcommands of bench: they still run, with a note, for one release
MOVED = {"tune": "tune", "percore": "percore", "planbench": "plan", "accuracy": "accuracy", "zoo": "zoo",
         "topk": "topk", "latent": "latent"}

DESCRIPTION = "Ring attention (context parallelism) on CPUs with MPI and NumPy."
EPILOG = ("commands:\n" + "".join(f"  {name:<10}{what}\n" for name, (_, _, what) in COMMANDS.items())
          + "\n'python -m mpiring COMMAND --help' lists the options of a command.")
INTERRUPTED = 130  # the shell's code for a process ended by SIGINT


def command(name):
    """The function of command ``name``: ``(comm, args=None) -> exit code``."""
    return getattr(importlib.import_module(f"mpiring.tools.{COMMANDS[name][0]}"), name)


def parser(name):
    """The argument parser of command ``name``."""
    return getattr(importlib.import_module(f"mpiring.tools.{COMMANDS[name][0]}"), f"{name}_parser")()


def needs_mpi(name, args):
    """Whether command ``name`` runs under MPI with options ``args`` (its module may decide: ``<name>_needs_mpi``)."""
    module = importlib.import_module(f"mpiring.tools.{COMMANDS[name][0]}")
    decide = getattr(module, f"{name}_needs_mpi", None)
    return COMMANDS[name][1] if decide is None else decide(args)


def parse(argv):
    """``(command, options)`` of a command line (after ``python -m mpiring``), without running anything."""
    top = _top_parser().parse_args(_moved(argv))
    return top.command, parser(top.command).parse_args(top.args)


def _moved(argv, say=False):
    """``argv`` with a command that moved under ``bench`` spelled as now (``say``: a note on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in MOVED:
        if say:
            print(f"python -m mpiring {argv[0]} is deprecated: use python -m mpiring bench {MOVED[argv[0]]}",
                  file=sys.stderr)
        argv = ["bench", MOVED[argv[0]], *argv[1:]]
    return argv


def _top_parser():
    p = argparse.ArgumentParser(prog="python -m mpiring", usage="%(prog)s COMMAND [options]",
                                description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's options")
    return p


@contextlib.contextmanager
def _only_on_rank0(rank):
    """Output inside goes nowhere except on rank 0 (every rank parses; one says what is wrong)."""
    if rank == 0:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        yield


def _exit_code(exc):
    """The exit code a SystemExit stands for."""
    if exc.code is None:
        return 0
    return exc.code if isinstance(exc.code, int) else 1


def _abort(comm, code):
    """End the whole job after this rank's last words have left it.

    Abort kills every process at once; the launcher forwards output through a
    pipe, so give it a moment to pass on what this rank just printed.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(0.2)
    comm.Abort(code)


def _abort_hook(comm):
    """An excepthook for anything main() does not catch: print it, then end the whole job."""
    def hook(kind, value, tb):
        sys.__excepthook__(kind, value, tb)
        _abort(comm, 1)
    return hook


def _on_interrupt(rank):
    """A SIGINT handler: rank 0 says ``interrupted``, every rank ends with 130, no traceback.

    mpiexec passes Ctrl-C to every rank. A rank that left on its own would
    make mpiexec kill the others (SIGKILL, "BAD TERMINATION"), so each rank
    finalizes MPI first: that waits until every rank got here, and then all
    exit alike. Transfers still pending are left as they are; a watchdog ends
    the process anyway if finalizing takes longer than ``FINALIZE_WAIT``
    (a rank that never got the signal). Handlers run between Python bytecodes:
    the ring and the verifier wait in polling loops, so a rank gets here
    within one block's compute. A second SIGINT while the first is handled
    (a terminal's Ctrl-C reaches a rank twice: directly, and forwarded by
    mpiexec) returns at once: the first one's wait goes on, and the rank
    does not leave before the others.
    """
    busy = []

    def handler(signum, frame):
        if busy:
            return
        busy.append(signum)
        with contextlib.suppress(Exception):  # the interrupted code may be in the middle of a write
            sys.stdout.flush()
        if rank[0] == 0:
            os.write(2, b"interrupted\n")
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            tiles = sys.modules.get("mpiring.core.tiles")  # not imported: no helper thread polls MPI
            if tiles is not None:
                tiles.stop_helper_polls()  # the interrupted thread may be waiting for its helper's poll
            finalized = threading.Event()
            threading.Thread(target=_exit_unless, args=(finalized, FINALIZE_WAIT), daemon=True).start()
            grace = _exit_grace(mpi)
            mpi.Finalize()
            finalized.set()
            if grace:
                time.sleep(grace)
        _leave(INTERRUPTED)
    return handler


def _leave(code):
    """End this process with ``code`` as C's exit() does, without unwinding the interrupted Python code.

    Not os._exit: MPICH tells its process manager that the rank finalized (PMI_Finalize) from a C exit
    hook, and hydra takes a rank that leaves without it for a crash and kills the ranks still running
    (SIGKILL, "BAD TERMINATION"), which some of them were, by a few milliseconds, now and then.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    with contextlib.suppress(OSError, AttributeError):  # no C library to call: os._exit
        ctypes.CDLL(None).exit(code)
    os._exit(code)


FINALIZE_WAIT = 10.0  # seconds an interrupted rank waits for the others in MPI_Finalize
EXIT_GRACE = 5.0  # seconds an interrupted rank waits after finalizing under Open MPI, so the ranks leave together


def _exit_grace(mpi):
    """Seconds to wait after MPI_Finalize before leaving: none under MPICH, whose MPI_Finalize returns once every
    rank has called it and whose Hydra lets a finalized rank leave before the others (``_leave``: C's exit(),
    so PMI_Finalize is sent; tests/test_cli_errors.py); EXIT_GRACE elsewhere: Open MPI's MPI_Finalize need not
    wait for the others, and its mpirun ends the job once a rank leaves with a non-zero code, so a rank still
    finishing a tile (its handler runs after it) gets time to get there too."""
    try:
        return 0.0 if mpi.get_vendor()[0] == "MPICH" else EXIT_GRACE
    except Exception:  # noqa: BLE001 (no vendor known: the careful wait)
        return EXIT_GRACE


def _exit_unless(finalized, seconds):
    """The watchdog: exit at once unless MPI finalized within ``seconds`` (a rank that never got the signal
    holds the others in MPI_Finalize; the launcher then ends it)."""
    if not finalized.wait(seconds):
        os._exit(INTERRUPTED)


def main(argv=None, keep_handler=False):
    """Run a command line on this rank; ``keep_handler`` (the command line's own run): once the command is over,
    SIGINT is ignored to the process's end, so a Ctrl-C while MPI finalizes at exit cannot kill the rank."""
    rank = [launch_rank()]  # known before MPI starts; the real one once it has
    argv = _moved(argv, say=rank[0] == 0)
    try:  # --help, bad options and bad values: answered before MPI starts, by rank 0 alone
        with _only_on_rank0(rank[0]):
            top = _top_parser().parse_args(argv)
            parser(top.command).parse_args(top.args)
    except SystemExit as exc:
        return _exit_code(exc)
    func = command(top.command)
    if not needs_mpi(top.command, top.args):
        try:
            return func(None, top.args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    previous = signal.signal(signal.SIGINT, _on_interrupt(rank))
    try:
        return _main_mpi(func, top, rank)
    finally:  # the command line's own run: the command is over, a late Ctrl-C changes nothing (Python would
        # restore the default action before MPI finalizes at exit, and the signal would kill the rank)
        signal.signal(signal.SIGINT, signal.SIG_IGN if keep_handler else previous)


def _main_mpi(func, top, rank):
    """Run an MPI command on every rank: see the module's docstring for how the job ends."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank[0] = comm.Get_rank()
    sys.excepthook = _abort_hook(comm)
    verdicts = comm.Dup()  # rank 0's verdict goes out on a duplicate: a Ctrl-C during it finalizes MPI with the
    # broadcast pending, which MPICH turned into a crash (exit 11) on COMM_WORLD itself
    try:
        code = func(comm, top.args)
    except Agreed as exc:  # every rank has it: rank 0 says it, all leave with 2
        if rank[0] == 0:
            print(f"python -m mpiring {top.command}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # one rank leaving alone would leave the others waiting for it
        code = _exit_code(exc)
        if code == 0:
            return 0
        print(f"rank {rank[0]}: exit {code}", file=sys.stderr)
        if comm.Get_size() > 1:
            _abort(comm, code)
        return code
    except BaseException as exc:  # noqa: BLE001 (one failing rank must not leave the others waiting forever)
        print(f"rank {rank[0]}: error: {exc}", file=sys.stderr)
        if not isinstance(exc, ValueError):
            traceback.print_exc()
        sys.stderr.flush()
        if comm.Get_size() > 1:
            _abort(comm, 2)
        return 2
    return _rank0_code(verdicts, code)


def _rank0_code(comm, code):
    """Every rank leaves with rank 0's verdict (waiting for it without spinning on a core)."""
    import numpy as np

    verdict = np.array([code], np.int64)
    poll([comm.Ibcast(verdict, root=0)])
    return int(verdict[0])


if __name__ == "__main__":
    sys.exit(main(keep_handler=True))
