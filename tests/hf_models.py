"""Tiny transformers models for the tests of ``mpiring.hf``, and the families table of docs/training.md.

    mpiexec -n 4 python tests/hf_models.py [family ...]    # each family's largest differences from one process

One helper for every family (``FAMILIES``): ``build(name, attn)`` makes a
random-init model (2 layers, hidden 32, float64, the same parameters on
every rank), ``differences(comm, name, documents)`` trains it 3 SGD steps on
2 rows x 48 tokens under ``mpiring.hf`` over ``comm`` (zigzag) and in one
process with the family's reference attention, and returns the largest
|loss| and |parameter| differences. The reference is transformers' SDPA where
the family has it, else ``REFERENCE``: a dense float64 attention whose mask is
written from transformers' definitions.
"""

import collections
import sys

import torch
import transformers

import mpiring.hf

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, bos_token_id=1, eos_token_id=2, pad_token_id=0)
S, ROWS, STEPS, DOCUMENTS = 48, 2, 3, [0, 13, 30, 48]
REFERENCE = "float64 reference"
# float32 inside these float64 models (Gemma's RMSNorms, x.float(); Cohere2's LayerNorm; DeepSeek-V3's router) rounds
# attention's last-bit differences there: 2e-9 at most measured (tests/hf_models.py at P = 1..4)
FLOAT32 = 1e-7
# a NoPE layer after a chunked one, Llama 4's default attn_temperature_tuning (floor_scale 8192) on; dense MLPs:
# its MoE router's sigmoid computes in float32 (5.3e-9 measured at P = 8 with MoE layers)
LLAMA4 = dict(attention_chunk_size=8, no_rope_layers=[1, 0], moe_layers=[], intermediate_size_mlp=64)
MAMBA = dict(mamba_d_state=8, mamba_expand=1)

Family = collections.namedtuple("Family", "model config extra reference tolerance refused", defaults=(
    "sdpa", 1e-10, None))
FAMILIES = {  # name: the model, its config, what makes it tiny; refused: what the error names at P > 1
    "Llama": Family("LlamaForCausalLM", "LlamaConfig", {}),
    "Llama 4 chunked": Family("Llama4ForCausalLM", "Llama4TextConfig", LLAMA4),
    "Llama 4 temperature tuning": Family("Llama4ForCausalLM", "Llama4TextConfig", dict(LLAMA4, floor_scale=4),
                                         refused=r"layers\.1\.self_attn \(Llama4TextAttention\): "
                                                 r"attn_temperature_tuning=True \(floor_scale=4\)"),
    "Qwen2 sliding window": Family("Qwen2ForCausalLM", "Qwen2Config",
                                   dict(use_sliding_window=True, sliding_window=5, max_window_layers=0)),
    "Mistral": Family("MistralForCausalLM", "MistralConfig", dict(sliding_window=5)),
    "Qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", {}),
    "Qwen3 sliding window": Family("Qwen3ForCausalLM", "Qwen3Config",
                                   dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "Phi3": Family("Phi3ForCausalLM", "Phi3Config", {}),
    "OLMo2": Family("Olmo2ForCausalLM", "Olmo2Config", {}),
    "SmolLM3": Family("SmolLM3ForCausalLM", "SmolLM3Config", dict(no_rope_layers=[1, 0])),
    "Cohere2": Family("Cohere2ForCausalLM", "Cohere2Config",
                      dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
                      tolerance=FLOAT32),
    "GPT-NeoX": Family("GPTNeoXForCausalLM", "GPTNeoXConfig", {}),
    "Granite": Family("GraniteForCausalLM", "GraniteConfig", {}),
    "Qwen3-MoE": Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "DeepSeek-V3": Family("DeepseekV3ForCausalLM", "DeepseekV3Config",
                          dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                               head_dim=4, num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2,
                               n_group=1, topk_group=1, first_k_dense_replace=1, moe_intermediate_size=32),
                          tolerance=FLOAT32),
    "Gemma2": Family("Gemma2ForCausalLM", "Gemma2Config", dict(sliding_window=5), REFERENCE, FLOAT32),
    "Gemma3": Family("Gemma3ForCausalLM", "Gemma3TextConfig",
                     dict(sliding_window=5, layer_types=["sliding_attention", "full_attention"]),
                     tolerance=FLOAT32),
    "gpt-oss": Family("GptOssForCausalLM", "GptOssConfig",
                      dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2), REFERENCE),
    "LFM2": Family("Lfm2ForCausalLM", "Lfm2Config", dict(layer_types=["conv", "full_attention"]),
                   refused=r"Lfm2ShortConv at model\.layers\.0\.conv: a convolution along the sequence"),
    "Qwen3-Next": Family("Qwen3NextForCausalLM", "Qwen3NextConfig",
                         dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32),
                         refused=r"Qwen3NextGatedDeltaNet at model\.layers\.0\.linear_attn: a recurrence"),
    "Falcon-H1": Family("FalconH1ForCausalLM", "FalconH1Config",
                        dict(MAMBA, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_chunk_size=8),
                        refused=r"FalconH1Mixer at model\.layers\.0\.mamba, model\.layers\.1\.mamba: a recurrence"),
    "Jamba": Family("JambaForCausalLM", "JambaConfig",
                    dict(MAMBA, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4, num_experts=4,
                         num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                         use_mamba_kernels=False),
                    refused=r"JambaMambaMixer at model\.layers\.0\.mamba: a recurrence"),
}


def reference_attention(module, query, key, value, attention_mask, *, scaling, sliding_window=None, softcap=None,
                        s_aux=None, position_ids=None, **kwargs):
    """Dense float64 softmax attention over the whole sequence, the mask from transformers' definitions: key j
    visible to query i iff both are in one document (the position ids restart at every document), j <= i, and
    j > i - sliding_window (a window layer); logits soft-capped as c * tanh(s / c) (``softcap``); a sink logit per
    head joining each softmax's denominator only (``s_aux``, as gpt-oss's eager attention)."""
    assert attention_mask is None and position_ids is not None
    n = query.shape[-2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    doc = torch.cumsum(torch.cat([torch.ones(1), (position_ids[0, 1:] != position_ids[0, :-1] + 1).double()]), 0)
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


def build(name, attn, **config):
    """Family ``name``'s tiny model with attention ``attn``, the same parameters wherever it is built."""
    family = FAMILIES[name]
    config_class = getattr(transformers, family.config)
    fields = set(config_class.__dataclass_fields__)
    settings = {k: v for k, v in SMALL.items() if k in fields} | family.extra | config
    torch.manual_seed(0)
    # experts "eager": the grouped GEMMs of the mixtures of experts take no float64
    return getattr(transformers, family.model)._from_config(config_class(**settings), attn_implementation=attn,
                                                            experts_implementation="eager", dtype=torch.float64)


def batch_ids(length=S, rows=ROWS, seed=1):
    """The token ids of one batch, the same on every rank."""
    return torch.randint(0, SMALL["vocab_size"], (rows, length), generator=torch.Generator().manual_seed(seed))


def train(model, cp, ids, documents=None, steps=STEPS):
    """``steps`` SGD steps of ``model`` on ``ids`` under ``cp``: the batch's loss at each step."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
    for _ in range(steps):
        batch = cp.shard(ids, documents=documents)
        inputs = batch.inputs if mpiring.hf.edge.runs_mpiring(model) else {
            k: v for k, v in batch.inputs.items() if k != "mpiring"}
        loss = cp.loss(model(**inputs).logits, batch)
        loss.backward()
        cp.all_reduce_gradients(model)
        opt.step()
        opt.zero_grad()
        losses.append(cp.reduce(loss))
    return losses


def differences(comm, name, documents=None, **config):
    """Family ``name`` trained under mpiring.hf over ``comm`` and in one process with its reference: the largest
    |loss| and |parameter| differences, the same on every rank."""
    from mpi4py import MPI

    torch.set_num_threads(1)
    ids = batch_ids()
    reference = build(name, FAMILIES[name].reference, **config)
    with mpiring.hf.ContextParallel(MPI.COMM_SELF, layout="contiguous") as one:
        want = train(reference, one, ids, documents)
    with mpiring.hf.ContextParallel(comm, layout="zigzag") as cp:
        model = build(name, "mpiring", **config)
        got = train(model, cp, ids, documents)
    loss = max(abs(a - b) for a, b in zip(got, want))
    params = max(float((p - r).detach().abs().max()) for p, r in zip(model.parameters(), reference.parameters()))
    return loss, params


if __name__ == "__main__":
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for name in sys.argv[1:] or FAMILIES:
        for documents in (None, DOCUMENTS):
            try:
                text = "loss {:.1e}, parameters {:.1e}".format(*differences(comm, name, documents))
            except ValueError as exc:
                text = f"ValueError: {str(exc)[:150]}"
            if comm.rank == 0:
                print(f"P={comm.size} {name} ({'packed' if documents else 'one document'}): {text}", flush=True)
