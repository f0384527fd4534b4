"""Every snippet and command of the tutorial runs, and its shown outputs are real.

    python -m pytest --with-mpi -q tests/test_docs.py

docs/tutorial.md: its ```python blocks run in order in one namespace; in its
```sh blocks every line starting with ``python -m mpiring`` or ``mpiexec`` runs
as a subprocess (exit code 0); a ```text block right after a ``schedule``
command must show lines that command prints. Everything runs in a temporary
directory (with docs/img/), so the committed pictures are not overwritten.
Other docs/*.md: their ``python -m mpiring`` command lines must parse.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
TUTORIAL = DOCS / "tutorial.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False


def blocks(path):
    """``[(language, text), ...]`` of the fenced code blocks of a Markdown file."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def commands(text):
    return [line.strip() for line in text.splitlines()
            if line.strip().startswith(("python -m mpiring", "mpiexec"))]


def _argv(line):
    """A documented command as an argv: our interpreter for python, mpiexec from PATH."""
    words = shlex.split(line)
    i = words.index("python")
    launcher = words[:i]
    if launcher:
        launcher[0] = shutil.which(launcher[0]) or launcher[0]
    return launcher + [sys.executable] + words[i + 1:]


def _needs_mpl(text):
    return "--plot" in text or "plot_" in text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tutorial")
    (path / "docs" / "img").mkdir(parents=True)
    return path


def test_tutorial_runs(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    namespace, previous, ran = {"__name__": "__tutorial__"}, None, 0
    for lang, text in blocks(TUTORIAL):
        if lang == "python":
            if _needs_mpl(text) and not HAVE_MPL:
                continue
            exec(compile(text, f"{TUTORIAL.name} python block", "exec"), namespace)
            ran += 1
        elif lang == "sh":
            for line in commands(text):
                if (_needs_mpl(line) and not HAVE_MPL) or (line.startswith("mpiexec") and not shutil.which("mpiexec")):
                    continue
                result = subprocess.run(_argv(line), capture_output=True, text=True, timeout=120, cwd=workdir,
                                        env=dict(os.environ))
                assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
                for out in re.findall(r"--plot (\S+)", line):
                    assert (workdir / out).stat().st_size > 1000, out
                previous = (line, result.stdout)
                ran += 1
            continue
        elif lang == "text" and previous and " schedule " in previous[0]:
            shown = [ln.rstrip() for ln in text.splitlines() if ln.strip()]
            printed = {ln.rstrip() for ln in previous[1].splitlines()}
            missing = [ln for ln in shown if ln not in printed]
            assert not missing, f"{previous[0]} does not print {missing}"
        previous = None
    assert ran >= 20


def test_tutorial_pictures_exist():
    """The pictures the tutorial shows are committed next to it."""
    for name in re.findall(r"\]\((img/[^)]+)\)", TUTORIAL.read_text()):
        assert (DOCS / name).is_file(), name


@pytest.mark.parametrize("path", sorted(p.name for p in DOCS.glob("*.md") if p != TUTORIAL))
def test_other_docs_commands_parse(path):
    from mpiring.__main__ import parse

    for lang, text in blocks(DOCS / path):
        for line in commands(text):
            words = shlex.split(line.split("#")[0])
            parse(words[words.index("mpiring") + 1:])
