"""Correct, and not a ring: head-parallel attention (Ulysses, the solution of lab 7) under the forward contract.

    mpiexec -n 4 python -m mpiring grade tests/students/head_parallel.py     # passes

The forward exercise's cases have a multiple of P heads, so a head-parallel ring_attention can be graded.
"""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[2] / "examples" / "exercises" / "solutions" / "07_ulysses.py"
_spec = importlib.util.spec_from_file_location("ulysses_solution", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
ring_attention = _module.ulysses_attention
