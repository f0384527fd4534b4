"""Every snippet and command of the tutorial runs, and its shown outputs are real.

    python -m pytest --with-mpi -q tests/test_docs.py

docs/tutorial.md: its ```python blocks run in order in one namespace; in its
```sh blocks every line starting with ``python -m mpiring`` or ``mpiexec`` runs
as a subprocess (exit code 0); a ```text block right after a ``schedule``
command must show lines that command prints. Everything runs in a temporary
directory, and the tutorial's scratch files ``/tmp/mpiring-*`` go there too, so
concurrent runs do not share them; the committed pictures in docs/img/ (drawn
by run/figures) must come out untouched. Other docs/*.md: their ``python -m
mpiring`` command lines must parse, docs/training.md runs as one script,
docs/masks.md's ALiBi snippet runs, and every section between ``<!-- checked: begin -->``
and ``<!-- checked: end -->`` runs as one under mpiexec, printing the ```text block it shows.
"""

import hashlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from launch import MPIEXEC, clean_env, mpiexec_argv

DOCS = Path(__file__).resolve().parent.parent / "docs"
TUTORIAL = DOCS / "tutorial.md"
SCRATCH = "/tmp/mpiring-"  # where the tutorial's pictures and traces go
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False
try:
    import torch  # noqa: F401

    HAVE_TORCH = True
except ImportError:
    HAVE_TORCH = False


def blocks(path):
    """``[(language, text), ...]`` of the fenced code blocks of a Markdown file."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(path.read_text())]


def commands(text):
    return [line.strip() for line in text.splitlines()
            if line.strip().startswith(("python -m mpiring", "mpiexec"))]


def _argv(line):
    """A documented command as an argv: our interpreter for python, ``mpiexec -n N`` as tests/launch.py runs it."""
    words = shlex.split(line)
    i = words.index("python")
    launcher, command = words[:i], [sys.executable] + words[i + 1:]
    if not launcher:
        return command
    assert launcher[:2] == ["mpiexec", "-n"], line
    return mpiexec_argv(int(launcher[2]), *launcher[3:], *command)


def _in(workdir, text):
    """``text`` with the tutorial's scratch paths moved into ``workdir``."""
    return text.replace(SCRATCH, f"{workdir}/mpiring-")


def _pictures():
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((DOCS / "img").iterdir())}


def _needs_mpl(text):
    return "--plot" in text or "plot_" in text


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("tutorial")


def test_tutorial_runs(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    pictures = _pictures()
    namespace, previous, ran = {"__name__": "__tutorial__"}, None, 0
    for lang, text in blocks(TUTORIAL):
        if lang == "python":
            if _needs_mpl(text) and not HAVE_MPL:
                continue
            exec(compile(_in(workdir, text), f"{TUTORIAL.name} python block", "exec"), namespace)
            ran += 1
        elif lang == "sh":
            for line in commands(text):
                if (_needs_mpl(line) and not HAVE_MPL) or (line.startswith("mpiexec") and MPIEXEC is None):
                    continue
                result = subprocess.run(_argv(_in(workdir, line)), capture_output=True, text=True, timeout=120,
                                        cwd=workdir, env=clean_env())
                assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
                for out in re.findall(r"--plot (\S+)", _in(workdir, line)):
                    assert Path(out).stat().st_size > 1000, out
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
    assert _pictures() == pictures, "following the tutorial changed docs/img/"


def test_tutorial_writes_only_to_scratch():
    """No command or snippet of the tutorial names docs/img/: that is run/figures' job."""
    for _, text in blocks(TUTORIAL):
        assert "docs/img" not in text, text
        for out in re.findall(r"--plot (\S+)|--trace (\S+)|plot_\w+\(\"([^\"]+)", text):
            assert "".join(out).startswith(SCRATCH), out


def test_tutorial_pictures_exist():
    """The pictures the tutorial shows are committed next to it."""
    for name in re.findall(r"\]\((img/[^)]+)\)", TUTORIAL.read_text()):
        assert (DOCS / name).is_file(), name


@pytest.mark.parametrize("path", sorted(p.name for p in DOCS.glob("*.md") if p != TUTORIAL))
def test_other_docs_commands_parse(path):
    from mpiring.__main__ import parse

    for _, text in blocks(DOCS / path):
        for line in commands(text):
            words = shlex.split(line.split("#")[0])
            if "mpiring" in words:  # not example scripts (tests/test_examples.py runs those)
                parse(words[words.index("mpiring") + 1:])


def test_alibi_slopes_snippet_runs():
    """docs/masks.md, "ALiBi's slopes": its python block runs (one process, COMM_SELF) and its asserts hold."""
    section = (DOCS / "masks.md").read_text().split("### ALiBi's slopes", 1)[1].split("\n#", 1)[0]
    code = [text for lang, text in (m.groups() for m in FENCE.finditer(section)) if lang == "python"]
    assert len(code) == 1
    exec(compile(code[0], "docs/masks.md (ALiBi's slopes)", "exec"), {})


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("guide,P", [("training.md", 2), pytest.param("training.md", 3, marks=pytest.mark.full),
                                     ("mixers.md", 2)])
def test_guide_runs(tmp_path, guide, P):
    """docs/training.md and docs/mixers.md: the python blocks run in order as one script under mpiexec -n P
    (PyTorch blocks only where torch is installed), and the text blocks they show are what the script prints."""
    guide = DOCS / guide
    code, shown = [], []
    for lang, text in blocks(guide):
        if lang == "python" and ("import torch" not in text or HAVE_TORCH):
            code.append(text)
        elif lang == "text":
            shown += [ln.rstrip() for ln in text.splitlines() if ln.strip()]
    _runs_and_prints(tmp_path, P, code, shown)


def _runs_and_prints(tmp_path, P, code, shown):
    """``code`` (python blocks) runs as one script under mpiexec -n P and prints every line of ``shown``."""
    script = tmp_path / "blocks.py"
    script.write_text("\n".join(code))
    result = subprocess.run(mpiexec_argv(P, sys.executable, str(script)), capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    printed = {ln.rstrip() for ln in result.stdout.splitlines()}
    assert code and shown and not [ln for ln in shown if ln not in printed], result.stdout


CHECKED = re.compile(r"<!-- checked: begin -->\n(.*?)<!-- checked: end -->", re.S)
SECTIONS = {f"{p.name}:{i}": text for p in sorted(DOCS.glob("*.md")) for i, text in
            enumerate(CHECKED.findall(p.read_text()))}


def test_the_checked_sections_are_found():
    assert {"masks.md:0", "inference.md:0"} <= set(SECTIONS)


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_checked_sections_run(tmp_path, section, P):
    """A checked section's python blocks run as one script under mpiexec -n P and print its text blocks."""
    code = [text for lang, text in FENCE.findall(SECTIONS[section]) if lang == "python"]
    shown = [ln.rstrip() for lang, text in FENCE.findall(SECTIONS[section]) if lang == "text"
             for ln in text.splitlines() if ln.strip()]
    _runs_and_prints(tmp_path, P, code, shown)
