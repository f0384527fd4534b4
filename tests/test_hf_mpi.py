"""Hugging Face models under context parallelism (``mpiring.hf``) equal the same models trained in one process.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_hf_mpi.py
    MPIRING_HF_SWEEP=1 mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_hf_mpi.py   # every family

Every family of ``hf_models.FAMILIES`` (2 layers, hidden 32, float64, 2 rows
x 48 tokens, zigzag, 3 SGD steps, packed documents and one document): every
rank's loss and parameters against the same model trained in one process
with transformers' SDPA (or a dense float64 attention written from
transformers' definitions, where the family has no SDPA; the hybrids' mixers as
float64 loops; the hybrids also at initializer_range=0.2 and both layouts). The families
mpiring cannot run exactly at P > 1 raise a ValueError on every rank naming
the layer, and train exactly at P = 1. The default run takes each family at
one P (2, 3 or 4 in turn; Llama 4's chunked attention at every P);
``MPIRING_HF_SWEEP=1`` takes every family at every P.
"""

import copy
import os
import re
import runpy
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="mpiring.hf needs torch (pip install -e '.[torch]')")
transformers = pytest.importorskip("transformers", reason="mpiring.hf needs transformers (pip install -e '.[hf]')")

from hf_models import DOCUMENTS, FAMILIES, HYBRIDS, build, differences  # noqa: E402

import mpiring  # noqa: E402
import mpiring.hf  # noqa: E402

# P = 1, 2 and 3 (uneven shards) in the quick suite; run/test --full adds P = 4
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3)]

S, DOCS = 24, [0, 7, 16, 24]
SWEEP = os.environ.get("MPIRING_HF_SWEEP") == "1"
EVERY_P = {"Llama 4 chunked"}  # at every P in the default run too
EXACT = [name for name, family in FAMILIES.items() if family.refused is None]
REFUSED = [name for name, family in FAMILIES.items() if family.refused is not None]


def _at_this_p(name, size):
    """Whether the default run takes family ``name`` at P = ``size`` (the sweep takes every P)."""
    return SWEEP or name in EVERY_P or size == 2 + list(FAMILIES).index(name) % 3


@pytest.mark.parametrize("documents", [DOCUMENTS, None], ids=["packed", "one document"])
@pytest.mark.parametrize("name", EXACT)
def test_family_trains_as_in_one_process(comm, name, documents):
    if not _at_this_p(name, comm.size):
        pytest.skip("the default run takes this family at another P (MPIRING_HF_SWEEP=1: at every P)")
    loss, params = differences(comm, name, documents)
    tol = FAMILIES[name].tolerance
    assert loss <= tol and params <= tol, (loss, params)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("init", [0.2, None], ids=["initializer_range=0.2", "default init"])
@pytest.mark.parametrize("documents", [DOCUMENTS, None], ids=["packed", "one document"])
@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_trains_exactly(comm, name, documents, init, layout):
    """The hybrids' convolutions and recurrences through mpiring (halos, states passed between ranks, restarting at
    every document), against float64 loops in one process: 1e-10 once what the models compute in float32 computes
    in float64 (``float64_inside``; as transformers runs them, ``FAMILIES[name].tolerance`` above). The default
    run takes initializer_range=0.2 only."""
    if not _at_this_p(name, comm.size) or (init is None and not SWEEP):
        pytest.skip("the default run takes this family at another P, initializer_range=0.2 (MPIRING_HF_SWEEP=1: all)")
    loss, params = differences(comm, name, documents, layout, inside64=True,
                               **({} if init is None else {"initializer_range": init}))
    assert loss <= 1e-10 and params <= 1e-10, (loss, params)


def test_rank_local_mixers_are_caught(comm, monkeypatch):
    """Planted: the hybrids' kernels left to transformers (each rank's shard alone, its state from zero, no halo):
    the comparison above fails at P > 1."""
    if comm.size == 1:
        pytest.skip("each rank's shard is the whole sequence at P = 1")
    monkeypatch.setattr(mpiring.hf.mixers, "LAYERS", {cls: (kind, ()) for cls, (kind, _) in
                                                      mpiring.hf.mixers.LAYERS.items()})
    for name in HYBRIDS:
        loss, params = differences(comm, name, DOCUMENTS, inside64=True, initializer_range=0.2)
        assert params > 1e-6, (name, loss, params)


@pytest.mark.parametrize("name", REFUSED)
def test_refused_family_raises_on_every_rank(comm, name):
    """P > 1: a ValueError on every rank naming the layer (and the field), before any ring; P = 1: exact."""
    if comm.size == 1:
        loss, params = differences(comm, name, DOCUMENTS)
        assert loss <= 1e-10 and params <= 1e-10, (loss, params)
        return
    with pytest.raises(ValueError, match=FAMILIES[name].refused):
        differences(comm, name, DOCUMENTS)


def test_shard_shifts_labels_on_the_whole_sequence(comm):
    """Labels shifted before sharding, none across a document's end; position ids restart per document."""
    ids = torch.arange(S).reshape(1, S) + 100
    with mpiring.hf.ContextParallel(comm, layout="zigzag") as cp:
        batch = cp.shard(ids, documents=DOCS)
        mine = mpiring.shard_indices(S, comm.size, comm.rank, "zigzag")
        assert batch.input_ids.tolist() == [(mine + 100).tolist()]
        ends = set(np.asarray(DOCS[1:]) - 1)
        assert batch.shift_labels.tolist() == [[-100 if t in ends else t + 101 for t in mine]]
        starts = np.asarray(DOCS[:-1])
        assert batch.position_ids.tolist() == [(mine - starts[np.searchsorted(starts, mine, "right") - 1]).tolist()]
        assert batch.tokens == S - len(DOCS) + 1
        assert cp.shard(ids, position_ids="global").position_ids.tolist() == [mine.tolist()]
        with pytest.raises(ValueError, match="documents must rise strictly from 0 to the sequence length 24"):
            cp.shard(ids, documents=[0, 30])


def test_rings_are_kept_per_length_and_options(comm):
    """A loop over varying lengths reuses its handles; the oldest beyond max_rings is closed."""
    with mpiring.hf.ContextParallel(comm, max_rings=2) as cp:
        model = build("Llama", "mpiring")
        first = {}
        for length in (8, 16, 8, 24):  # 8 served again by its handle, so 16 is the oldest when 24 comes
            ids = torch.randint(0, 64, (1, length * comm.size), generator=torch.Generator().manual_seed(length))
            model(**cp.shard(ids).inputs)
            first.setdefault(length, next(reversed(cp._rings.values())))
        assert [key[0] for key in cp._rings] == [8 * comm.size, 24 * comm.size]
        assert next(iter(cp._rings.values())) is first[8]


def test_unsupported_arguments_name_themselves(comm):
    """Padding masks, attention dropout, a missing context: a clear error on every rank, nothing ignored."""
    ids = torch.randint(0, 64, (1, 4 * comm.size), generator=torch.Generator().manual_seed(0))
    with mpiring.hf.ContextParallel(comm) as cp:
        batch = cp.shard(ids)
        model = build("Llama", "mpiring")
        mask = torch.ones_like(batch.input_ids)
        mask[:, -1] = 0
        with pytest.raises(ValueError, match="attention_mask: padded batches are not supported"):
            model(**batch.inputs, attention_mask=mask)
        model(**batch.inputs, attention_mask=torch.ones_like(mask))  # no padding: served
        with pytest.raises(ValueError, match=r"cu_seq_lens_q=\[0, 2, \d+\] differs from the documents given"):
            model(**batch.inputs, cu_seq_lens_q=torch.tensor([0, 2, 4 * comm.size]))
        with pytest.raises(ValueError, match="needs its context at every call"):
            model(input_ids=batch.input_ids)
        dropping = build("Llama", "mpiring")
        dropping.config.attention_dropout = 0.1
        for layer in dropping.model.layers:
            layer.self_attn.attention_dropout = 0.1
        with pytest.raises(ValueError, match="dropout=0.1: attention dropout is not mapped by mpiring.hf"):
            dropping.train()(**batch.inputs)


def test_bfloat16_model_runs_in_its_dtype(comm):
    """A bfloat16 model needs no upcast: out and gradients stay bfloat16, near the float64 model's."""
    ids = torch.randint(0, 64, (1, 4 * comm.size), generator=torch.Generator().manual_seed(2))
    with mpiring.hf.ContextParallel(comm) as cp:
        batch = cp.shard(ids)
        exact = build("Llama", "mpiring")
        half = copy.deepcopy(exact).to(torch.bfloat16)
        logits = [m(**batch.inputs).logits for m in (exact, half)]
        assert logits[1].dtype == torch.bfloat16
        cp.loss(logits[1], batch).backward()
        assert all(p.grad.dtype == torch.bfloat16 for p in half.parameters())
        # a whole model in bfloat16 (not only attention): 2^-8 per rounding, a few layers deep
        torch.testing.assert_close(logits[1].double(), logits[0].detach(), atol=5e-2, rtol=5e-2)


def test_train_hf_example_matches_one_process(comm, capsys, monkeypatch):
    """examples/train_hf.py, run in this job's ranks (COMM_WORLD, as mpiexec gives it): rank 0 prints losses and
    parameters within 1e-10 of the same Llama trained in one process with transformers' SDPA."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "train_hf.py")
    monkeypatch.setattr(sys, "argv", [path])
    runpy.run_path(path, run_name="__main__")
    printed = capsys.readouterr().out.strip()
    if comm.rank == 0:
        loss, params = re.search(r"loss (\S+), parameters (\S+)$", printed).groups()
        assert float(loss) <= 1e-10 and float(params) <= 1e-10, printed
