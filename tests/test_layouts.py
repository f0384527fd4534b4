"""Sharding the sequence: contiguous, zigzag and striped, and their inverse."""

import numpy as np
import pytest

from mpiring.plans.layouts import LAYOUTS, block_range, shard, shard_indices, unshard


def test_block_range_covers_everything_once():
    for n in range(0, 30):
        for size in range(1, 7):
            spans = [block_range(n, size, r) for r in range(size)]
            assert sum(c for c, _ in spans) == n
            assert all(spans[r][1] + spans[r][0] == spans[r + 1][1] for r in range(size - 1))
            assert max(c for c, _ in spans) - min(c for c, _ in spans) <= 1


def test_layout_definitions():
    assert [list(shard_indices(8, 2, r, "contiguous")) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # zigzag: 2P = 4 chunks of 2; rank r holds chunks r and 2P-1-r
    assert [list(shard_indices(8, 2, r, "zigzag")) for r in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert [list(shard_indices(8, 2, r, "striped")) for r in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("seq_len,size", [(12, 1), (12, 3), (13, 4), (8, 8), (31, 3)])
def test_unshard_inverts_shard(layout, seq_len, size):
    x = np.arange(2 * seq_len * 3).reshape(2, seq_len, 3)
    pieces = [shard(x, size, r, layout) for r in range(size)]
    assert np.array_equal(unshard(pieces, layout), x)
    held = np.concatenate([shard_indices(seq_len, size, r, layout) for r in range(size)])
    assert sorted(held) == list(range(seq_len))
    assert all(np.all(np.diff(shard_indices(seq_len, size, r, layout)) > 0) for r in range(size))


def test_bad_layout():
    with pytest.raises(ValueError, match="layout must be one of"):
        shard_indices(8, 2, 0, "spiral")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape, axis", [((11,), None), ((2, 11), -1), ((2, 11, 3, 4), 1), ((3, 11, 5), None),
                                          ((11, 2), 0)])
def test_shard_any_axis_and_1d(layout, shape, axis):
    """shard/unshard on any axis (1-D arrays by default on their only axis); views exactly where documented."""
    x = np.arange(np.prod(shape)).reshape(shape)
    seq_axis = (0 if len(shape) == 1 else -2) if axis is None else axis
    S = shape[seq_axis]
    pieces = [shard(x, 3, r, layout, axis) for r in range(3)]
    for r, p in enumerate(pieces):
        np.testing.assert_array_equal(p, np.take(x, shard_indices(S, 3, r, layout), axis=seq_axis))
        assert np.shares_memory(p, x) == (layout != "zigzag")
    np.testing.assert_array_equal(unshard(pieces, layout, axis), x)
