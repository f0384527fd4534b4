"""``python -m mpiring run`` in which one rank calls ``sys.exit(3)`` at its second block (tests/test_cli_errors.py).

    mpiexec -n 3 python tests/cli_exit_job.py --seq-len 96 --heads 2 --dim 8
"""

import sys

from mpi4py import MPI

import mpiring.core.block
from mpiring.__main__ import main

if __name__ == "__main__":
    if MPI.COMM_WORLD.Get_rank() == 1:
        real, calls = mpiring.core.block.attend, [0]

        def attend(*args, **kwargs):
            calls[0] += 1
            if calls[0] == 2:
                print("rank 1: sys.exit(3)", file=sys.stderr, flush=True)
                sys.exit(3)
            return real(*args, **kwargs)

        mpiring.core.block.attend = attend
    sys.exit(main(["run", *sys.argv[1:]]))
