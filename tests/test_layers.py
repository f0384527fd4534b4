"""The package's layers: imports flow one way, no cycles, small modules, and ``import mpiring`` changes nothing.

    python -m pytest -q tests/test_layers.py

Every module under mpiring/ is parsed with ``ast`` (nothing is imported) and
every import inside the package, at module level or inside a function, is an
edge of the graph. Layers, lowest first::

    core < plans < cost < mpi < parallel < top-level API < tools < __main__

A module may import its own layer or lower ones, never a higher one, and the
graph has no cycle. No loop calls the public API: the grid runs the ring
across its groups with the loop ``parallel.strategies`` hands it. Every
module of mpi/ uses MPI, and no two modules share a file name.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mpiring"
LAYERS = ["core", "plans", "cost", "mpi", "parallel", "api", "tools", "__main__"]  # lowest first
SUBPACKAGES = {"core", "plans", "cost", "mpi", "parallel", "tools"}
MAX_TOP_LEVEL = 15
MAX_LINES = 500


def module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(name):
    """The layer of module ``name``: its sub-package, "api" for the top level, or "__main__"."""
    parts = name.split(".")
    if len(parts) == 1:
        return "api"  # mpiring/__init__.py
    if parts[1] in SUBPACKAGES:
        return parts[1]
    return "__main__" if parts[1] == "__main__" else "api"


def _target(base, name):
    """What ``from base import name`` imports: the module base.name if it is one, else base."""
    return f"{base}.{name}" if f"{base}.{name}" in MODULES else base


def imports(name):
    """``[(imported module, line)]`` of every intra-package import of module ``name``, wherever it is."""
    path = MODULES[name]
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module
            if base == "mpiring" or base.startswith("mpiring."):
                found += [(_target(base, alias.name), node.lineno) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names
                      if alias.name == "mpiring" or alias.name.startswith("mpiring.")]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in ("_LAZY", "COMMANDS",
                                                                                      "SUBCOMMANDS")
                                                  for t in node.targets):
            # imported by name at run time: __init__'s lazy names, __main__'s commands, bench's subcommands
            values = [v.value if isinstance(v, ast.Constant) else v.elts[0].value for v in node.value.values]
            prefix = {"mpiring": "mpiring.", "mpiring.__main__": "mpiring.tools."}.get(name, name + ".")
            found += [(prefix + v, node.lineno) for v in values]
    for target, line in found:
        assert target in MODULES, f"{name}:{line} imports {target}, which is not a module of mpiring"
    return [(t, line) for t, line in found if t != name]


GRAPH = {name: imports(name) for name in MODULES}


def test_the_graph_sees_the_package():
    assert {"mpiring", "mpiring.handle", "mpiring.core.kernels", "mpiring.tools.cli"} <= set(MODULES)
    edges = {(a, b) for a, targets in GRAPH.items() for b, _ in targets}
    assert ("mpiring.handle", "mpiring.parallel.strategies") in edges
    assert ("mpiring", "mpiring.handle") in edges  # a lazy name
    assert ("mpiring.__main__", "mpiring.tools.cli_run") in edges  # a command
    assert ("mpiring.tools.bench", "mpiring.tools.bench.micro") in edges  # a subcommand


def test_imports_flow_down():
    """No module imports a higher layer (function-level imports included)."""
    upward = [f"{MODULES[a].relative_to(ROOT)}:{line} ({layer(a)}) imports {b} ({layer(b)})"
              for a, targets in GRAPH.items() for b, line in targets
              if LAYERS.index(layer(b)) > LAYERS.index(layer(a))]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_cycles():
    """No import cycle, at module level or through function-level imports."""
    edges = {a: sorted({b for b, _ in targets}) for a, targets in GRAPH.items()}
    cycles, state = [], {}

    def visit(node, path):
        state[node] = "open"
        for nxt in edges[node]:
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_top_level_is_small():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"{len(top)} modules at the top level of mpiring/: {top}"


def test_no_module_over_the_line_guide():
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_import_changes_nothing_in_the_process():
    """``import mpiring`` in a fresh interpreter: os.environ as it was, and no mpi4py (so no MPI)."""
    code = ("import json, os, sys; before = dict(os.environ); import mpiring; "
            "print(json.dumps([mpiring.__file__, dict(os.environ) == before, "
            "sorted(set(os.environ) ^ set(before)), 'mpi4py' in sys.modules]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    path, same, changed, mpi4py = json.loads(done.stdout)
    assert Path(path).resolve() == PACKAGE / "__init__.py"
    assert same, f"import mpiring changed os.environ: {changed}"
    assert not mpi4py, "import mpiring imported mpi4py"


@pytest.mark.parametrize("name", ["make_plan", "simulate", "attention_block", "balance", "Record"])
def test_planning_names_need_no_mpi(name):
    """Names of the layers below MPI come without mpi4py."""
    code = f"import sys, mpiring; mpiring.{name}; print('mpi4py' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stdout + done.stderr


def test_submodules_are_attributes_loaded_when_used():
    """``mpiring.masks`` and ``mpiring.testing`` after ``import mpiring`` alone, without torch or mpi4py; torch
    comes with ``mpiring.torch`` (and ``mpiring.hf``), where it is installed."""
    code = ("import importlib.util, json, sys, mpiring; m = mpiring.masks.causal() | mpiring.masks.prefix(2); "
            "t = mpiring.testing.TOLERANCE; before = sorted({'torch', 'mpi4py'} & set(sys.modules)); "
            "has = importlib.util.find_spec('transformers') is not None; "
            "names = [mpiring.torch.__name__, mpiring.hf.__name__, 'torch' in sys.modules] if has else []; "
            "print(json.dumps([type(m).__name__, before, names, sorted(dir(mpiring))]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    mask, before, names, listed = json.loads(done.stdout)
    assert mask == "Or" and before == []
    assert names in ([], ["mpiring.torch", "mpiring.hf", True])
    assert {"masks", "testing", "torch", "hf"} <= set(listed)


PLAN_CLASSES = {"HybridPlan", "UlyssesPlan", "DoubleRingPlan"}
LOOKS_AT_THE_MODE = {"mpiring.plans.spec", "mpiring.plans.make", "mpiring.parallel.strategies",
                     "mpiring.cost.by_strategy"}  # the spec, the plan builder, the strategy table, the cost builder


def _names_the_mode(node):
    """``mode``, ``strategy``, ``x.mode`` or ``x.strategy``: an expression that names the strategy."""
    return (isinstance(node, ast.Name) and node.id in ("mode", "strategy")) or \
        (isinstance(node, ast.Attribute) and node.attr in ("mode", "strategy"))


def mode_looks(source):
    """Lines of ``source`` that branch on the strategy: compare the mode (or the strategy's name), look it up in a
    table, or test a plan's class."""
    tree = ast.parse(source)
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(map(_names_the_mode, [node.left, *node.comparators])):
            lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _names_the_mode(node.slice):
            lines.append(node.lineno)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2 \
                and {n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & PLAN_CLASSES:
            lines.append(node.lineno)
    return sorted(lines)


def test_only_the_spec_the_tables_and_the_builders_look_at_the_mode():
    """At most 4 package modules outside tools/ tell the strategies apart; the rest ask the tables."""
    looks = {name: mode_looks(path.read_text()) for name, path in MODULES.items()
             if layer(name) not in ("tools", "__main__")}
    looking = {name: lines for name, lines in looks.items() if lines}
    assert set(looking) <= LOOKS_AT_THE_MODE, {n: lines for n, lines in looking.items() if n not in LOOKS_AT_THE_MODE}
    assert len(LOOKS_AT_THE_MODE) <= 4


def test_the_mode_detector_sees_each_kind_of_look():
    source = ("if plan.mode == 'ulysses':\n    pass\n"
              "x = TABLE[plan.strategy]\ny = isinstance(plan, (Plan, HybridPlan))\n")
    assert mode_looks(source) == [1, 3, 4]
    assert mode_looks("if merge == 'ring':\n    pass\nz = plan.mode\nout[mode] = 1\n") == []  # naming is not looking


# ---------------------------------------------------------------- the size of functions

MAX_PARAMETERS = 12  # a public function's; the rest of the options go through the spec (``Spec.of``)
MAX_FUNCTION_LINES = 80
WIDE = {  # public functions with more parameters, and why (none: the rest of the options go through the spec)
}
LONG = {  # functions over MAX_FUNCTION_LINES, and why
    "mpiring.core.kernels.attention_block": "the tiled kernel, its hot loop in one piece",
    "mpiring.core.kernels.attention_block_backward": "the tiled backward kernel, its hot loop in one piece",
}


def functions(source):
    """``[(name, parameters, lines)]`` of every function and method in ``source`` (self and cls not counted)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
            names += [x.arg for x in (a.vararg, a.kwarg) if x]
            found.append((node.name, len(names), node.end_lineno - node.lineno + 1))
    return found


def every_function():
    return [(f"{name}.{f}", n, lines) for name, path in MODULES.items() for f, n, lines in functions(path.read_text())]


def test_no_public_function_takes_more_than_twelve_parameters():
    wide = {name: n for name, n, _ in every_function() if n > MAX_PARAMETERS and not name.rsplit(".", 1)[1][0] == "_"}
    assert set(wide) <= set(WIDE), {name: n for name, n in wide.items() if name not in WIDE}
    assert not set(WIDE) - set(wide), f"exempt but no longer wide: {set(WIDE) - set(wide)}"


def test_no_function_is_longer_than_eighty_lines_outside_the_kernels():
    long = {name: lines for name, _, lines in every_function() if lines > MAX_FUNCTION_LINES}
    assert set(long) <= set(LONG), {name: lines for name, lines in long.items() if name not in LONG}


def test_the_function_counter_counts_parameters_and_lines():
    source = "def f(a, b=1, *c, d, **e):\n    pass\n\n\nclass K:\n    def g(self, x):\n        return x\n"
    assert functions(source) == [("f", 5, 2), ("g", 1, 2)]


def _private(name):
    return name.startswith("_") and not name.startswith("__")


def _defined_private_names(tree):
    """The private names a module binds: functions, classes, variables, arguments and attributes it assigns."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
            names.add(node.id if isinstance(node, ast.Name) else node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if _private(n)}


def private_uses(sources):
    """``name:line what`` for each private name (``_x``, not ``__x__``) a module takes from another module of the
    package: ``from .other import _x``, or ``obj._x`` where only another module defines ``_x`` (a module, class
    or instance attribute: ``plan._mask_options()`` from tools/ reaching into plans/)."""
    trees = {name: ast.parse(source) for name, source in sources.items()}
    defined = {name: _defined_private_names(tree) for name, tree in trees.items()}
    anywhere = set().union(*defined.values())
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("mpiring")):
                found += [f"{name}:{node.lineno} imports {alias.name}" for alias in node.names if _private(alias.name)]
            elif isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in anywhere - defined[name]:
                found.append(f"{name}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_private_name_crosses_modules():
    """What two modules share is public inside the package: no module takes another's ``_private`` name."""
    crossing = private_uses({name: path.read_text() for name, path in MODULES.items()})
    assert not crossing, "private names used across modules:\n" + "\n".join(crossing)


def test_the_private_name_check_sees_imports_and_attributes():
    sources = {"a": "_LIMIT = 1\nclass Plan:\n    def _options(self):\n        return {}\n",
               "b": "from .a import _LIMIT\nfrom . import a\nx = a._LIMIT\n",
               "c": "def show(plan):\n    return plan._options(), plan._own\n",
               "d": "class D:\n    def __init__(self, other):\n        self._own = other._own\n"}
    assert sorted(private_uses(sources)) == ["b:1 imports _LIMIT", "b:3 uses a._LIMIT", "c:2 uses plan._options",
                                             "c:2 uses plan._own"]  # d's own attribute of another D: its own


# ---------------------------------------------------------------- names and contents

def test_no_two_modules_share_a_name():
    """One file name, one module (``__init__`` and ``__main__`` aside): ``reference`` names one thing."""
    by_name = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.stem not in ("__init__", "__main__"):
            by_name.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"modules that share a name: {shared}"


def imports_mpi4py(name):
    """Whether module ``name`` imports mpi4py anywhere (at module level or inside a function)."""
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "mpi4py" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "mpi4py":
            return True
    return False


def using_mpi(graph, direct):
    """The modules of ``graph`` (``{name: [(imported, line)]}``) that import mpi4py (``direct``) or, through any
    chain of imports, a module that does."""
    using = set(direct)
    grew = True
    while grew:
        more = {a for a, targets in graph.items() if a not in using and any(b in using for b, _ in targets)}
        using |= more
        grew = bool(more)
    return using


def test_every_module_in_mpi_uses_mpi():
    """mpi/ holds what uses MPI: each of its modules imports mpi4py or a module that does."""
    using = using_mpi(GRAPH, {name for name in MODULES if imports_mpi4py(name)})
    without = sorted(n for n in MODULES if n.startswith("mpiring.mpi.") and n not in using)
    assert not without, f"modules in mpi/ that use no MPI (move them to the layer they belong to): {without}"


def test_the_mpi_use_check_follows_imports():
    graph = {"a": [("b", 1)], "b": [("c", 3)], "c": [], "d": [("a", 2)], "e": []}
    assert using_mpi(graph, {"c"}) == {"a", "b", "c", "d"}
    assert using_mpi(graph, set()) == set()
