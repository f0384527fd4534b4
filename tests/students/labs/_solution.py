"""The labs' solutions (examples/exercises/solutions/), loaded by file name, for the planted wrong versions here."""

import importlib.util
from pathlib import Path

SOLUTIONS = Path(__file__).resolve().parents[3] / "examples" / "exercises" / "solutions"


def solution(name):
    """The module of solution ``name`` (e.g. "09_gqa")."""
    spec = importlib.util.spec_from_file_location(f"solution_{name}", SOLUTIONS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
