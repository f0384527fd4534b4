"""docs/masks.md's pictures are what ``python -m mpiring schedule --mask ...`` draws, and the mask algebra's rules
(bounds hold every visible key; parse; errors) hold."""

import pathlib
import re
import shlex

import numpy as np
import pytest

import mpiring
from mpiring import masks
from mpiring.cost.plantext import sparsity_text
from mpiring.plans.visibility import BIG, count_visible

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "masks.md"
PICTURES = re.findall(r"```text\n\$ python -m mpiring schedule (.*?)\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_its_pictures():
    assert len(PICTURES) >= 7


@pytest.mark.parametrize("command, picture", PICTURES, ids=[c for c, _ in PICTURES])
def test_each_picture_is_what_schedule_draws(command, picture, capsys):
    from mpiring.tools.cli_plan import schedule
    schedule(None, shlex.split(command))
    drawn = capsys.readouterr().out
    assert drawn.split("block sparsity:", 1)[1].split("\n", 1)[1] == picture


PIECES = [masks.causal(), masks.window(3, 1), masks.documents([0, 5, 9, 20]), masks.frames(4), masks.prefix(6),
          masks.causal() | masks.prefix(6), masks.window(2, 0) | masks.function(lambda q, k: k % 7 == 0),
          masks.frames(5) & masks.window(6, 0), masks.function(lambda q, k: (q - k) % 3 == 0) | masks.prefix(0)]


@pytest.mark.parametrize("piece", PIECES, ids=repr)
def test_bounds_hold_every_visible_key_and_exact_means_exact(piece):
    pos = np.arange(20, dtype=np.int64)
    lo, hi = piece.bounds(pos)
    ok = piece.allows(pos[:, None], pos[None, :])
    inside = (pos[None, :] >= lo[:, None]) & (pos[None, :] <= hi[:, None])
    assert not np.any(ok & ~inside), "a visible key outside the bounds"
    if piece.exact:
        assert np.array_equal(ok, inside & (lo[:, None] <= hi[:, None]))
    assert np.all(np.diff(np.clip(lo, -1, 99)) >= 0) and np.all(np.diff(np.clip(hi, -1, 99)) >= 0)
    counts, full = count_visible(pos, pos, {"mask": (piece,)})
    assert np.array_equal(counts, ok.sum(axis=1)) and full == bool(ok.all())


def test_padding_is_per_batch_entry():
    pad = masks.padding(np.array([3, 7]))
    assert pad.batched and not pad.exact
    ok = pad.allows(np.arange(8)[:, None], np.arange(8)[None, :])
    assert ok.shape == (2, 8, 8) and ok[0].sum() == 24 and ok[1].sum() == 56
    assert not masks.padding(np.array([5, 5])).batched
    assert pad.bounds(np.arange(3))[1].tolist() == [6, 6, 6]
    assert BIG > 10 ** 15


def test_parse_and_its_errors():
    assert masks.parse("causal|prefix:4") == masks.causal() | masks.prefix(4)
    assert masks.parse("window:3,0&documents:0,5,9") == masks.window(3, 0) & masks.documents([0, 5, 9])
    for bad, said in (("nope", "unknown mask piece 'nope'"), ("prefix:x", "mask piece 'prefix:x'"),
                      ("window:-3,0", "window left must be")):
        with pytest.raises(ValueError, match=re.escape(said)):
            masks.parse(bad)
    with pytest.raises(TypeError, match="only with another mask piece"):
        masks.causal() | True


def test_functions_compare_by_what_they_are():
    def make(n):
        return masks.function(lambda q, k: k < n)
    assert make(3) == make(3) and make(3) != make(4)
    assert mpiring.Spec.of(mask=make(3)).digest == mpiring.Spec.of(mask=make(3)).digest


def test_the_balancers_count_a_mask_with_holes_from_its_definition():
    mask = masks.function(lambda q, k: (k <= q) & (k >= q - 8)) | masks.prefix(16)  # a window and a prefix
    parts = mpiring.balance(128, 4, method="greedy", mask=mask)
    assert sorted(np.concatenate(parts).tolist()) == list(range(128))
    pos = np.arange(128)
    rows = mask.allows(pos[:, None], pos[None, :]).sum(axis=1)
    loads = [int(rows[p].sum()) for p in parts]
    assert max(loads) / (sum(loads) / 4) < 1.1


def test_sparsity_text_of_a_plan_with_a_function_mask():
    plan = mpiring.make_plan(32, 4, mask=masks.function(lambda q, k: (q // 8) == (k // 8)))
    text = sparsity_text(plan, cells=4)
    assert text.splitlines()[1:5] == ["  #...", "  .#..", "  ..#.", "  ...#"]
    assert text.splitlines()[-4:] == ["  #...", "  .#..", "  ..#.", "  ...#"]
