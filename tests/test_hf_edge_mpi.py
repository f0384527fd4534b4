"""The model edge of ``mpiring.hf``: what it maps, what it refuses on every rank, generation, accumulation.

    mpiexec -n 3 python -m pytest --with-mpi -m mpi -q tests/test_hf_edge_mpi.py

Tiny float64 models from ``hf_models``. Refusals are checked on every rank
(each rank asserts its own ValueError), before any ring runs.
"""

import types

import pytest

torch = pytest.importorskip("torch", reason="mpiring.hf needs torch (pip install -e '.[torch]')")
transformers = pytest.importorskip("transformers", reason="mpiring.hf needs transformers (pip install -e '.[hf]')")

from hf_models import DOCUMENTS, S, batch_ids, build  # noqa: E402

import mpiring.hf  # noqa: E402
from mpiring.hf import edge  # noqa: E402

# P = 1, 2 and 3 (uneven shards) in the quick suite, as tests/test_hf_mpi.py; run/test --full adds P = 4
pytestmark = [pytest.mark.mpi, pytest.mark.ranks(1, 2, 3)]
GENERATION = "generation under context parallelism is not supported by mpiring.hf"


def test_chunks_become_documents(comm):
    """Llama 4's chunks (of position ids) cut every document: the Ring's documents of a chunked layer."""
    with mpiring.hf.ContextParallel(comm) as cp:
        call = cp.shard(batch_ids(), documents=DOCUMENTS).inputs["mpiring"]
        assert call.documents(None) == tuple(DOCUMENTS)
        assert call.documents(8) == (0, 8, 13, 21, 29, 30, 38, 46, 48)  # chunks restart in every document
        glob = cp.shard(batch_ids(), documents=DOCUMENTS, position_ids="global").inputs["mpiring"]
        assert glob.documents(8) == (0, 8, 13, 16, 24, 30, 32, 40, 48)  # chunks of the global positions
        assert cp.shard(batch_ids()).inputs["mpiring"].documents(16) == (0, 16, 32, 48)


def test_unmapped_mixer_is_refused_before_any_ring(comm):
    """The model is inspected at its first call, before its first layer: a refused layer (Bamba's Mamba-2 mixer,
    not mapped) ends the forward on every rank (P > 1) before any Ring exists; the escape hatch, named as such,
    runs it on each shard alone."""
    ids = batch_ids()
    with mpiring.hf.ContextParallel(comm) as cp:
        model = build("Bamba", "mpiring")
        if comm.size > 1:
            with pytest.raises(ValueError, match=r"at P=\d: BambaMixer at model\.layers\.0\.mamba: a recurrence"
                                                 r".*allow_unsharded"):
                model(**cp.shard(ids).inputs)
            assert not cp._rings
        else:
            assert cp.prepare(model) == [
                ("model.layers.0.mamba", "BambaMixer", "state space",
                 "each rank's shard alone: exact at P = 1, refused at P > 1"),
                ("model.layers.1.self_attn", "BambaAttention", "attention", "mpiring's ring attention")]
    with mpiring.hf.ContextParallel(comm, allow_unsharded=["BambaMixer"]) as unsharded:
        model = build("Bamba", "mpiring")
        rows = unsharded.prepare(model)
        assert ("model.layers.0.mamba", "BambaMixer", "state space",
                "allowed unsharded: each rank's shard alone") in rows
        reference = build("Bamba", "sdpa")
        batch = unsharded.shard(ids)
        got = model(**batch.inputs).logits
        want = reference(input_ids=ids).logits[:, batch.positions]
        gap = float((got - want).detach().abs().max())
        assert (gap > 1e-6) if comm.size > 1 else (gap < 1e-12), gap  # the recurrence does mix tokens


def test_hybrid_mixers_are_mapped_only_in_cp_calls(comm):
    """LFM2's convolution is mapped (its row says how); in a cp forward its kernel is mpiring's, after it and
    outside cp transformers' again (the model, with sdpa, equals one never run under cp); a padding mask, given on
    rank 0 only, is refused by the mixer on every rank, naming it."""
    from transformers.models.lfm2 import modeling_lfm2

    ids = batch_ids()
    kernel = modeling_lfm2.causal_conv1d_fn
    with mpiring.hf.ContextParallel(comm) as cp:
        model = build("LFM2", "mpiring")
        assert cp.prepare(model)[0] == ("model.layers.0.conv", "Lfm2ShortConv", "convolution",
                                        "mpiring's causal_conv1d (halo exchange)")
        batch = cp.shard(ids)
        model(**batch.inputs)
        assert modeling_lfm2.causal_conv1d_fn is kernel
        mask = torch.ones_like(batch.input_ids)
        mask[:, -1] = 0
        with pytest.raises(ValueError, match="Lfm2ShortConv: a padding mask"):
            model(**batch.inputs, attention_mask=mask if comm.rank == 0 else None)
        assert modeling_lfm2.causal_conv1d_fn is kernel
    model.set_attn_implementation("sdpa")
    assert torch.equal(model(input_ids=ids).logits, build("LFM2", "sdpa")(input_ids=ids).logits)


def test_mixers_run_before_the_inspection_are_refused(comm):
    """A 4-D mask skips transformers' mask function: the model is inspected at its first attention call, after
    LFM2's convolution ran unmapped; that forward ends on every rank saying to prepare the model first."""
    with mpiring.hf.ContextParallel(comm) as cp:
        batch = cp.shard(batch_ids())
        n = batch.input_ids.shape[1]
        with pytest.raises(ValueError, match=r"sequence mixers at model\.layers\.0\.conv \(Lfm2ShortConv\) ran "
                                             r"before mpiring.hf inspected the model: call ContextParallel\.prepare"):
            build("LFM2", "mpiring")(**batch.inputs, attention_mask=torch.ones(2, 1, n, n, dtype=torch.bool))


def test_wrapped_model_is_inspected_whole(comm):
    """The model found at the first call is the outermost module called: a wrapper, the model inside it."""
    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, **inputs):
            return self.inner(**inputs).logits

    with mpiring.hf.ContextParallel(comm) as cp:
        wrapper = Wrapper(build("Llama", "mpiring"))
        batch = cp.shard(batch_ids())
        wrapper(**batch.inputs)
        assert [path for path, *_ in cp._models[wrapper]] == [f"inner.model.layers.{i}.self_attn" for i in (0, 1)]
        with pytest.raises(ValueError, match=GENERATION):  # the transformers models inside are armed
            wrapper.inner.generate(**batch.inputs)
        with pytest.raises(ValueError, match=GENERATION):
            wrapper.inner.model(**{**batch.inputs, "use_cache": True})


def test_mapping_problems_are_refused_at_every_p(comm):
    """An attention pattern mpiring does not map is refused at every P, naming the field."""
    with mpiring.hf.ContextParallel(comm) as cp:
        windows = build("Llama 4 chunked", "mpiring", layer_types=["window_attention", "full_attention"])
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(Llama4TextAttention\): layer_types\[0\]="
                                             r"'window_attention' is an attention pattern mpiring.hf does not map"):
            cp.prepare(windows)
        unchunked = build("Llama 4 chunked", "mpiring", layer_types=["full_attention", "full_attention"])
        with pytest.raises(ValueError, match="attention_chunk_size=8 without 'chunked_attention' in layer_types"):
            cp.prepare(unchunked)


def test_a_window_only_the_mask_has_is_refused(comm):
    """Phimoe builds transformers' sliding-window mask from config.sliding_window but passes no sliding_window
    to its attention: refused at every P (mpiring would attend to every earlier token)."""
    config = transformers.PhimoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                                       sliding_window=5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with mpiring.hf.ContextParallel(comm) as cp:
        model = transformers.PhimoeForCausalLM._from_config(config, attn_implementation="mpiring",
                                                            dtype=torch.float64)
        with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn \(PhimoeAttention\): config sliding_window"
                                             r"=5 but the call passes no sliding_window"):
            model(**cp.shard(batch_ids()).inputs)


def test_the_table_finds_mixers_by_type_name_and_config():
    """Generic finds: a convolution over the sequence (kernel > 1, not 1), torch's MultiheadAttention, an RNN, a
    layer type named only by the config; the sliding-window checks of a Site."""
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.smooth, self.pointwise = torch.nn.Conv1d(4, 4, 3), torch.nn.Conv1d(4, 4, 1)
            self.mha, self.rnn = torch.nn.MultiheadAttention(4, 1), torch.nn.GRU(4, 4)
            self.config = types.SimpleNamespace(to_dict=dict, layer_types=["conv", "moe", "hybrid_sliding"])

    mapped, rows, local, everywhere = edge.inspect(Toy())
    assert not mapped and not everywhere and len(rows) == 3
    text = "; ".join(local)
    assert "Conv1d at smooth: a convolution along the sequence" in text and "pointwise" not in text
    assert "MultiheadAttention at mha: attention computed by the module itself" in text
    assert "GRU at rnn: a recurrence" in text
    assert "layers [2] of type 'hybrid_sliding' (layer_types): a recurrence" not in text  # GRU's reason, found
    assert "layers [0] of type 'conv'" not in text and "'moe'" not in text
    everywhere = []
    bare = types.SimpleNamespace(to_dict=dict, layer_types=["conv", "linear_attention", "index_me"])
    assert edge._field_problems(bare, {}, everywhere) == [
        "layers [0] of type 'conv' (layer_types): " + edge.CONVOLUTION,
        "layers [1] of type 'linear_attention' (layer_types): " + edge.RECURRENCE]
    assert everywhere == ["layers [2] of type 'index_me' (layer_types): a layer type mpiring.hf does not map"]
    sliding = edge.Site("a", "sliding_attention", window="layer type 'sliding_attention'")
    assert "a: layer type 'sliding_attention' but the call passes no sliding_window" in sliding.problem(S, 2, None)
    assert sliding.problem(S, 2, 5) is None
    assert "passes sliding_window=5" in edge.Site("a", "full_attention").problem(S, 2, 5)
    tuned = edge.Site("a", "full_attention", floor_scale=8192)
    assert tuned.problem(S, 4, None) is None and tuned.problem(8192, 1, None) is None
    assert "floor_scale=8192" in tuned.problem(8192, 2, None)


def test_generation_is_refused_saying_how_to_generate(comm):
    """A cache, generate and a forward without the context: one clear error on every rank, saying how to generate
    (one rank, sdpa, the whole prompt: that works, and matches the same model built with sdpa)."""
    ids = batch_ids(16, 1)
    with mpiring.hf.ContextParallel(comm) as cp:
        batch = cp.shard(ids)
        model = build("Llama", "mpiring")
        with pytest.raises(ValueError, match=GENERATION):  # before any forward: the attention refuses the cache
            model.generate(input_ids=batch.input_ids, max_new_tokens=2)
        with pytest.raises(ValueError, match=GENERATION):  # before any forward, with the context: not
            model.generate(**batch.inputs, max_new_tokens=2)  # transformers' "model_kwargs not used: mpiring"
        with pytest.raises(ValueError, match=GENERATION):
            model(**{**batch.inputs, "use_cache": True})
        model(**batch.inputs)  # inspected: the model now refuses generate and caches at its entry
        with pytest.raises(ValueError, match=GENERATION + r".*set_attn_implementation\(\"sdpa\"\).*KVCache"):
            model.generate(**batch.inputs, max_new_tokens=2)
        with pytest.raises(ValueError, match=GENERATION):
            model.generate(input_ids=batch.input_ids, max_new_tokens=2)
        with pytest.raises(ValueError, match="config.use_cache is True: " + GENERATION):
            model(**{k: v for k, v in batch.inputs.items() if k != "use_cache"})
        with pytest.raises(ValueError, match=GENERATION):
            model(**batch.inputs, past_key_values=transformers.DynamicCache(config=model.config))
        gemma = build("Gemma3", "mpiring")  # its attention gets no use_cache: the first call's entry says it
        with pytest.raises(ValueError, match=GENERATION):
            gemma(**{**batch.inputs, "use_cache": True})
    model.set_attn_implementation("sdpa")
    tokens = model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(tokens, build("Llama", "sdpa").generate(input_ids=ids, max_new_tokens=3, do_sample=False))


def test_loss_refuses_logits_no_mpiring_attention_made(comm):
    """A model built with sdpa ignores the mpiring= keyword: at P > 1 its logits are refused by cp.loss."""
    with mpiring.hf.ContextParallel(comm) as cp:
        batch = cp.shard(batch_ids())
        logits = build("Llama", "sdpa")(**batch.inputs).logits
        if comm.size > 1:
            with pytest.raises(ValueError, match="no attention layer ran through mpiring in the forward"):
                cp.loss(logits, batch)
        else:
            assert torch.isfinite(cp.loss(logits, batch))


@pytest.mark.parametrize("micro", [2, 3])
def test_accumulated_micro_batches_equal_one_batch(comm, micro):
    """N micro-batches, each loss over the whole batch's token count (``tokens=``), gradients accumulated then
    all-reduced once: the loss and gradients of the N micro-batches' rows as one batch, to 1e-12 in float64;
    each micro-batch's own count instead (their labelled tokens differ) does not give them."""
    ids = batch_ids(rows=2 * micro)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.3] = -100  # uneven counts
    with mpiring.hf.ContextParallel(comm) as cp:
        grads, losses = [], []
        for whole in (True, False, None):
            model = build("Llama", "mpiring")
            if whole:
                parts = [cp.shard(ids, labels, documents=DOCUMENTS)]
            else:
                parts = [cp.shard(ids[2 * i:2 * i + 2], labels[2 * i:2 * i + 2], documents=DOCUMENTS)
                         for i in range(micro)]
            tokens = sum(b.tokens for b in parts) if whole is False else None
            loss = 0.0
            for batch in parts:
                part = cp.loss(model(**batch.inputs).logits, batch, tokens=tokens)
                part.backward()
                loss += cp.reduce(part)
            cp.all_reduce_gradients(model)
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
            losses.append(loss)
    assert len({b.tokens for b in parts}) > 1
    assert abs(losses[1] - losses[0]) <= 1e-12 and float((grads[1] - grads[0]).abs().max()) <= 1e-12
    assert abs(losses[2] - losses[0]) > 1e-3  # each micro-batch's own mean: not the batch's


def test_gradient_checkpointing_recomputes_through_mpiring(comm):
    """transformers recomputes a checkpointed decoder layer's forward in the backward, outside any model call:
    Jamba's mixer (which gets no keywords from its decoder layer) still finds the forward's context there, and
    the gradients equal those without checkpointing."""
    grads = []
    with mpiring.hf.ContextParallel(comm) as cp:
        for checkpointing in (False, True):
            model = build("Jamba", "mpiring", initializer_range=0.2)
            if checkpointing:
                model.activation_checkpointing_enable()
            batch = cp.shard(batch_ids(), documents=DOCUMENTS)
            cp.loss(model.train()(**batch.inputs).logits, batch).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert float((grads[1] - grads[0]).abs().max()) <= 1e-12
