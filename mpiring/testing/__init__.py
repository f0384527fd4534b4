"""A testing kit for anyone testing a distributed attention under MPI (pytest, pytest-mpi, hypothesis).

    mpiexec -n 4 python -m pytest --with-mpi -q my_tests/     # with ``from mpiring.testing import ring_comm``
                                                              # in my_tests/conftest.py (docs/testing.md)

- ``reference`` / ``reference_backward``: dense float64 attention and its gradients from the definitions;
  ``TOLERANCE``: one tolerance table.
- ``assert_attention_close``, ``assert_sharded_attention``, ``assert_on_all_ranks``: failures that name
  the rank, global position, head and the K/V block that differs, one verdict on every rank.
- ``strict``: a communicator for any code that takes an mpi4py one: synchronous sends, every wait
  timed (``Stuck``), a ledger of traffic per rank; ``strict_comm`` and ``ring_comm`` fixtures.
- ``attention_problems``: a hypothesis strategy constrained to what the code under test supports;
  shape helpers for sequence shards, head shards and (B, S, H*D) activations.

Only NumPy is imported here; mpi4py, pytest and hypothesis are imported when first needed.
"""

from .compare import assert_attention_close, assert_on_all_ranks, attention_error
from .expected import (
    TOLERANCE,
    dense_mask,
    latent_reference,
    latent_reference_backward,
    reference,
    reference_backward,
    tolerance,
)
from .fixtures import ring_comm_fixture, strict_comm_fixture
from .locate import assert_sharded_attention, diagnose_forward
from .problems import (
    AttentionProblem,
    attention_problems,
    head_indices,
    head_shard,
    local_shards,
    merge_heads,
    split_heads,
)

# with mpi4py (made on first use): strict, StrictComm, Stuck, Ledger, settle; with pytest: ring_comm, strict_comm
__all__ = ["TOLERANCE", "AttentionProblem", "Ledger", "StrictComm", "Stuck", "assert_attention_close",
           "assert_on_all_ranks", "assert_sharded_attention", "attention_error", "attention_problems", "dense_mask",
           "diagnose_forward", "head_indices", "head_shard", "latent_reference", "latent_reference_backward",
           "local_shards", "merge_heads", "reference", "reference_backward", "ring_comm", "ring_comm_fixture", "settle",
           "split_heads", "strict", "strict_comm", "strict_comm_fixture", "tolerance"]

_WITH_MPI = {"strict", "StrictComm", "Stuck", "Ledger", "settle"}
_FIXTURES = {"ring_comm": ring_comm_fixture, "strict_comm": strict_comm_fixture}


def __getattr__(name):
    # made on first use, so ``import mpiring.testing`` needs neither pytest nor mpi4py
    if name in _FIXTURES:
        value = _FIXTURES[name]()
    elif name in _WITH_MPI:
        from . import strictcomm, timed

        value = getattr(strictcomm if name in ("strict", "StrictComm") else timed, name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value
