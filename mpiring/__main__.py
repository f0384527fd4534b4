"""The command line of mpiring: a registry of commands, each a function ``(comm, args=None) -> exit code``.

    mpiexec -n 4 python -m mpiring run --seq-len 4096 --dim 64 --heads 8 --causal
    python -m mpiring schedule -P 4 --layout zigzag --causal
    mpiexec -n 4 python -m mpiring run --causal --trace trace.json --plot timeline.png   # see the ring
    python -m mpiring cost --seq-len 1048576 -P 8 --hidden 4096 --heads 32 --causal    # + time model
    mpiexec -n 2 python -m mpiring bench --quick        # the benchmark table (run/bench runs -n 1 and -n 2)

Every command lives in ``mpiring.tools``, owns its parser (``<command>_parser()``)
and prints on rank 0 only. Commands that need no MPI get ``comm=None`` and never
import mpi4py; the others get ``MPI.COMM_WORLD``, and every rank leaves with rank 0's exit code.
"""

import argparse
import importlib
import sys
import time
import traceback

# command: (module in mpiring.tools, needs MPI, what it does)
COMMANDS = {
    "run": ("cli_run", True, "run ring attention under mpiexec and verify it"),
    "schedule": ("cli_plan", False, "print the ring schedule (no MPI needed)"),
    "cost": ("cli_plan", False, "the analytical cost report, then the time model (no MPI needed)"),
    "bench": ("bench", True, "benchmark table under mpiexec -n 1 / -n 2 (see run/bench)"),
}

DESCRIPTION = "Ring attention (context parallelism) on CPUs with MPI and NumPy."
EPILOG = ("commands:\n" + "".join(f"  {name:<10}{what}\n" for name, (_, _, what) in COMMANDS.items())
          + "\n'python -m mpiring COMMAND --help' lists the options of a command.")


def command(name):
    """The function of command ``name``: ``(comm, args=None) -> exit code``."""
    return getattr(importlib.import_module(f"mpiring.tools.{COMMANDS[name][0]}"), name)


def parser(name):
    """The argument parser of command ``name``."""
    return getattr(importlib.import_module(f"mpiring.tools.{COMMANDS[name][0]}"), f"{name}_parser")()


def parse(argv):
    """``(command, options)`` of a command line (after ``python -m mpiring``), without running anything."""
    top = _top_parser().parse_args(argv)
    return top.command, parser(top.command).parse_args(top.args)


def _top_parser():
    p = argparse.ArgumentParser(prog="python -m mpiring", usage="%(prog)s COMMAND [options]",
                                description=DESCRIPTION, epilog=EPILOG,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help=", ".join(COMMANDS))
    p.add_argument("args", nargs=argparse.REMAINDER, help="the command's options")
    return p


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


def main(argv=None):
    top = _top_parser().parse_args(argv)
    func = command(top.command)
    if not COMMANDS[top.command][1]:
        try:
            return func(None, top.args)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    parser(top.command).parse_args(top.args)  # --help and bad options: answered before MPI starts
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sys.excepthook = _abort_hook(comm)
    try:
        code = func(comm, top.args)
    except Exception as exc:  # one failing rank must not leave the others waiting forever
        print(f"rank {comm.Get_rank()}: error: {exc}", file=sys.stderr)
        if not isinstance(exc, ValueError):
            traceback.print_exc()
        sys.stderr.flush()
        if comm.Get_size() > 1:
            _abort(comm, 2)
        return 2
    # every rank leaves with rank 0's verdict
    return comm.bcast(code, root=0)


if __name__ == "__main__":
    sys.exit(main())
