"""The quick suite's rules (conftest.py): the all-pairs cover of a sweep, and which tests run at which size.

    python -m pytest -q tests/test_quick_suite.py
"""

import itertools
import types

import pytest

import conftest
from conftest import all_pairs, module_sizes, quick_skip, sweep


@pytest.mark.parametrize("sizes", [(2, 2), (3, 3, 2, 2), (2, 2, 5, 4, 2, 2), (3, 3, 2, 4, 2), (4, 1, 3)])
def test_every_pair_of_values_meets(sizes):
    cover = all_pairs(sizes)
    assert cover <= set(itertools.product(*(range(n) for n in sizes)))
    for i, j in itertools.combinations(range(len(sizes)), 2):
        met = {(c[i], c[j]) for c in cover}
        assert met == set(itertools.product(range(sizes[i]), range(sizes[j]))), (i, j)
    assert cover == all_pairs(sizes)  # the same on every rank and every run


def test_the_cover_is_small():
    assert len(all_pairs((2, 2, 5, 4, 2, 2))) <= 25  # of 320
    assert all_pairs((4,)) == {(0,), (1,), (2,), (3,)}  # one factor: every value


def test_sweep_marks_the_cases_beyond_the_cover():
    names, params = sweep(a=[1, 2, 3], b={"x": "X", "y": "Y"},
                          c=[True, pytest.param(False, marks=pytest.mark.skip)])
    assert names == "a,b,c" and len(params) == 12
    full = [p for p in params if any(m.name == "full" for m in p.marks)]
    assert len(params) - len(full) == len(all_pairs((3, 2, 2)))
    assert {p.id for p in params} >= {"1-x-True", "3-y-False"}
    assert all(any(m.name == "skip" for m in p.marks) for p in params if p.values[2] is False)


def _item(ranks=None, full=False, comm=None):
    marks = {"ranks": types.SimpleNamespace(args=ranks) if ranks else None, "full": full or None}
    return types.SimpleNamespace(get_closest_marker=marks.get,
                                 callspec=types.SimpleNamespace(params={} if comm is None else {"comm": comm}))


def test_which_size_runs_what():
    assert quick_skip(_item(), 4) is None                     # unmarked: every size
    assert quick_skip(_item(ranks=(1, 2)), 2) is None
    assert quick_skip(_item(ranks=(1, 2)), 3)                 # not at 3
    assert quick_skip(_item(full=True), 1)                    # --full only
    assert quick_skip(_item(comm="world"), 3) is None
    assert quick_skip(_item(comm="dup"), 2) is None           # the comm variants at P = 2
    assert quick_skip(_item(comm="self"), 1) and quick_skip(_item(comm="dup"), 4)


def _case(name, **indices):
    """A fake parametrized MPI test case: ``indices`` its parameters' value indices."""
    marks = {"mpi": True}
    return types.SimpleNamespace(get_closest_marker=marks.get, path="t.py", cls=None, originalname=name,
                                 callspec=types.SimpleNamespace(params=dict(indices), indices=dict(indices)))


def test_spread_runs_every_case_at_2_and_each_value_at_the_other_sizes():
    from conftest import spread

    cases = [_case("t", layout=i, mask=j) for i in range(3) for j in range(4)] + [_case("u", strategy=s)
                                                                                  for s in range(5)]
    assert spread(cases, 2) == [] and spread(cases, 8) == []
    kept = {}
    for size in (1, 3, 4):
        left = {id(c) for c in spread(cases, size)}
        kept[size] = [c for c in cases if id(c) not in left]
        for name, n in (("layout", 3), ("mask", 4), ("strategy", 5)):
            assert {c.callspec.params[name] for c in kept[size] if name in c.callspec.params} == set(range(n))
        assert len([c for c in kept[size] if c.originalname == "t"]) == 4  # of 12: the most values of one
        assert spread(cases, size) == spread(cases, size)  # the same on every rank
    assert len({tuple(map(id, kept[size])) for size in kept}) == 3  # each size runs other cases


def test_module_sizes_read_from_the_source(tmp_path):
    """The sizes a module runs at, from its ranks markers (the module's and its tests'), without importing it: the
    quick suite does not import a module elsewhere. No module marker, or sizes not written out: it may run anywhere."""
    def sizes(source):
        path = tmp_path / "test_x.py"
        path.write_text("import pytest\n" + source)
        return module_sizes(path)
    assert sizes("pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3)]\nraise ImportError\n") == {1, 2, 3}
    assert sizes("pytestmark = pytest.mark.ranks(1, 2)\n\n@pytest.mark.ranks(4)\ndef test_a(): pass\n") == {1, 2, 4}
    assert sizes("pytestmark = pytest.mark.mpi\n\n@pytest.mark.ranks(1, 2)\ndef test_a(): pass\n") is None
    assert sizes("SIZES = (1, 2)\npytestmark = pytest.mark.ranks(*SIZES)\n") is None


def test_an_mpi_test_in_a_module_that_never_says_so_is_refused(tmp_path):
    """The MPI stages skip importing modules whose source never says pytest.mark.mpi; a module that marks its MPI
    tests otherwise (a marker imported under another name) is refused at collection, not silently left out."""
    hidden, plain = tmp_path / "test_hidden.py", tmp_path / "test_plain.py"
    hidden.write_text("from helpers import mpi_only\n")
    plain.write_text("import pytest\n\n@pytest.mark.mpi\ndef test_a(): pass\n")
    config = types.SimpleNamespace(getoption=lambda name, default=None: True)  # --full: no deselection follows
    items = [types.SimpleNamespace(path=plain, get_closest_marker={"mpi": True}.get)]
    conftest.pytest_collection_modifyitems(config, items)
    items.append(types.SimpleNamespace(path=hidden, get_closest_marker={"mpi": True}.get))
    with pytest.raises(pytest.UsageError, match="test_hidden.py"):
        conftest.pytest_collection_modifyitems(config, items)
