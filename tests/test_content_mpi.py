"""Equal data on every rank passes the content agreement, whatever objects hold it, and changes no result.

    mpiexec -n 3 python -m pytest -q --with-mpi -m mpi tests/test_content_mpi.py

Every rank builds its own copy of each mask's data (a torch tensor of
10,000 entries, a NumPy array inside a list, a global array, a partial, a
callable object, a default argument): the objects differ from rank to rank
(their addresses too), the contents do not. Each call must return, equal to
the float64 reference of the same mask, and bit for bit equal to the same
call with the rule written as a plain function (the agreement adds nothing
to what is computed). The refusals are tests/test_agreement.py's.
"""

import functools

import numpy as np
import pytest

import mpiring
from mpiring import masks
from mpiring.core.reference import definition_mask

from conftest import naive_attention

pytestmark = pytest.mark.mpi

S, H, D = 40, 2, 8
FLAGS = np.zeros(10_000, bool)
FLAGS[[3, 17]] = True


def plain(q, k):
    return ((k <= q) & (k > q - 5)) | np.isin(k, [3, 17])


def reads_global(q, k):
    return ((k <= q) & (k > q - 5)) | FLAGS[k]


def closing_over(flags):
    def rule(q, k):
        return ((k <= q) & (k > q - 5)) | np.asarray(flags[0])[k]
    return rule


def with_default(width=5, flags=FLAGS):
    def rule(q, k, width=width):
        return ((k <= q) & (k > q - width)) | flags[k]
    return rule


class Rule:
    def __init__(self, width, globals_):
        self.width, self.globals_ = width, globals_

    def __call__(self, q, k):
        return ((k <= q) & (k > q - self.width)) | np.isin(k, self.globals_)


def partial_rule(q, k, width, flags):
    return ((k <= q) & (k > q - width)) | flags[k]


def _rules():
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(10_000, dtype=torch.bool)
    tensor[[3, 17]] = True
    return {"torch tensor": closing_over([tensor.numpy()]), "list-wrapped array": closing_over([FLAGS.copy()]),
            "global": reads_global, "partial": functools.partial(partial_rule, width=5, flags=FLAGS.copy()),
            "callable object": Rule(5, [3, 17]), "default argument": with_default()}


@pytest.mark.parametrize("name", ["torch tensor", "list-wrapped array", "global", "partial", "callable object",
                                  "default argument"])
def test_equal_data_in_other_objects_passes_and_changes_nothing(comm, name):
    rule = _rules()[name]
    P, r = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(11)
    Q, K, V = (rng.standard_normal((1, H, S, D)) for _ in range(3))
    i = mpiring.shard_indices(S, P, r, "zigzag")
    shards = [a[..., i, :] for a in (Q, K, V)]
    out, lse = mpiring.ring_attention(*shards, comm, layout="zigzag", mask=masks.function(rule))
    same, same_lse = mpiring.ring_attention(*shards, comm, layout="zigzag", mask=masks.function(plain))
    assert np.array_equal(out, same) and np.array_equal(lse, same_lse)
    pos = np.arange(S)
    allowed = definition_mask(pos, pos, mask=(masks.function(plain),))
    np.testing.assert_allclose(out, naive_attention(Q, K, V, allowed)[..., i, :], atol=1e-12, rtol=0)
