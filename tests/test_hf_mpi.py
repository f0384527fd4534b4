"""Hugging Face models under context parallelism (``mpiring.hf``) equal the same models trained in one process.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_hf_mpi.py

Tiny random-init models (2 layers, hidden 32, float64), 3 SGD steps on a packed
batch: every rank's loss and parameters against the model trained on the whole
batch in one process with a dense float64 attention (``reference_attention``, its mask
from transformers' definitions): Gemma2's softcap and gpt-oss's trained sinks
(``s_aux``, its gradient through ``mpiring.torch``'s ``sinks``) included.
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

import mpiring  # noqa: E402
import mpiring.hf  # noqa: E402

# P = 1, 2 and 3 (uneven shards) in the quick suite; run/test --full adds P = 4
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3)]

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
MODELS = {  # name: (model class, config), all with grouped-query attention
    "llama": ("LlamaForCausalLM", "LlamaConfig", {}),
    "qwen2 sliding window": ("Qwen2ForCausalLM", "Qwen2Config",
                             dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    "mistral sliding window": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=5)),
    "gemma2 alternating windows": ("Gemma2ForCausalLM", "Gemma2Config",
                                   dict(sliding_window=5, attn_logit_softcapping=None, final_logit_softcapping=None)),
    "gemma2 softcap": ("Gemma2ForCausalLM", "Gemma2Config", dict(sliding_window=5)),
    "gpt-oss sinks": ("GptOssForCausalLM", "GptOssConfig",
                      dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2)),
}
# Gemma2's RMSNorm computes in float32 (x.float()) even in a float64 model: attention's last-bit differences
# may round its inputs differently there, so its float64 runs agree to float32's rounding, not 1e-10
TOLERANCE = {"gemma2 alternating windows": 1e-6, "gemma2 softcap": 1e-6}
S, DOCS, STEPS = 24, [0, 7, 16, 24], 3
REFERENCE = "float64 reference"


def reference_attention(module, query, key, value, attention_mask, *, scaling, sliding_window=None, softcap=None,
                        s_aux=None, **kwargs):
    """Dense float64 softmax attention over the whole packed sequence, the mask from transformers' definitions:
    key j visible to query i iff both are in one of DOCS, j <= i, and j > i - sliding_window (a window layer);
    logits soft-capped as c * tanh(s / c) (``softcap``); a sink logit per head joining each softmax's
    denominator only (``s_aux``, as gpt-oss's eager attention)."""
    assert attention_mask is None
    i, j = torch.arange(query.shape[-2])[:, None], torch.arange(key.shape[-2])[None, :]
    doc = torch.as_tensor(np.searchsorted(DOCS, np.arange(key.shape[-2]), side="right"))
    visible = (doc[:, None] == doc[None, :]) & (j <= i)
    if sliding_window is not None:
        visible &= j > i - sliding_window
    g = query.shape[1] // key.shape[1]
    key, value = (t.repeat_interleave(g, dim=1) for t in (key, value))
    scores = query @ key.transpose(-1, -2) * scaling
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if s_aux is not None:
        sink = s_aux.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return (probs @ value).transpose(1, 2).contiguous(), None


transformers.AttentionInterface.register(REFERENCE, reference_attention)
transformers.masking_utils.AttentionMaskInterface.register(REFERENCE, lambda *args, **kwargs: None)


def _model(name, attn):
    cls, config, extra = MODELS[name]
    config = getattr(transformers, config)(**SMALL, **extra)
    torch.manual_seed(0)  # the same initial parameters on every rank and in the reference
    # experts "eager": the grouped GEMM of gpt-oss's mixture of experts takes no float64
    return getattr(transformers, cls)._from_config(copy.deepcopy(config), attn_implementation=attn,
                                                   experts_implementation="eager", dtype=torch.float64)


def _train(model, cp, ids):
    """STEPS SGD steps of ``model`` on ``ids`` under ``cp``: the batch's loss at each step."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
    for _ in range(STEPS):
        batch = cp.shard(ids, documents=DOCS)
        inputs = batch.inputs if model.config._attn_implementation == cp.name else {
            k: v for k, v in batch.inputs.items() if k != "mpiring"}
        loss = cp.loss(model(**inputs).logits, batch)
        loss.backward()
        cp.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()
        losses.append(cp.reduce(loss))
    return losses


@pytest.mark.parametrize("name", MODELS)
def test_model_trains_as_in_one_process(comm, name):
    from mpi4py import MPI

    torch.set_num_threads(1)
    ids = torch.randint(0, SMALL["vocab_size"], (2, S), generator=torch.Generator().manual_seed(1))
    reference = _model(name, REFERENCE)
    with mpiring.hf.ContextParallel(MPI.COMM_SELF, layout="contiguous") as one:
        want = _train(reference, one, ids)
    with mpiring.hf.ContextParallel(comm, layout="zigzag") as cp:
        model = _model(name, "mpiring")
        got = _train(model, cp, ids)
    tol = TOLERANCE.get(name, 1e-10)
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    for (pname, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, atol=tol, rtol=0, msg=pname)


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
        model = _model("llama", "mpiring")
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
        model = _model("llama", "mpiring")
        mask = torch.ones_like(batch.input_ids)
        mask[:, -1] = 0
        with pytest.raises(ValueError, match="attention_mask: padded batches are not supported"):
            model(**batch.inputs, attention_mask=mask)
        model(**batch.inputs, attention_mask=torch.ones_like(mask))  # no padding: served
        with pytest.raises(ValueError, match=r"cu_seq_lens_q=\[0, 2, \d+\] differs from the documents given"):
            model(**batch.inputs, cu_seq_lens_q=torch.tensor([0, 2, 4 * comm.size]))
        with pytest.raises(ValueError, match="needs its context at every call"):
            model(input_ids=batch.input_ids)
        dropping = _model("llama", "mpiring")
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
        exact = _model("llama", "mpiring")
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
