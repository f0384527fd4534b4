"""Tiny transformers models for the tests of ``mpiring.hf``, and the families table of docs/training.md.

    mpiexec -n 4 python tests/hf_models.py [family ...]    # each family's largest differences from one process

One helper for every family (``FAMILIES``): ``build(name, attn)`` makes a
random-init model (2 layers, hidden 32, float64, the same parameters on
every rank), ``differences(comm, name, documents)`` trains it 3 SGD steps on
2 rows x 48 tokens under ``mpiring.hf`` over ``comm`` (zigzag) and in one
process with the family's reference attention, and returns the largest
|loss| and |parameter| differences. The reference is transformers' SDPA where
the family has it, else ``REFERENCE``: a dense float64 attention whose mask is
written from transformers' definitions. The hybrids' sequence mixers run, in
the reference, as float64 loops restarting at every document
(``reference_kernels``; transformers' CPU fallbacks compute in float32 and run
packed documents together).

    mpiexec -n 4 python tests/hf_models.py --hybrids    # the hybrids: layouts x init x documents, float64 inside
"""

import collections
import contextlib
import importlib
import itertools
import sys

import numpy as np
import torch
import transformers
from mixer_loops import loop_conv, loop_linear, loop_scan, loop_ssd

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
HYBRIDS = ("LFM2", "Qwen3-Next", "Falcon-H1", "Jamba")  # their sequence mixers mapped (mpiring.hf.mixers)

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
    "LFM2": Family("Lfm2ForCausalLM", "Lfm2Config", dict(layer_types=["conv", "full_attention"])),
    "Qwen3-Next": Family("Qwen3NextForCausalLM", "Qwen3NextConfig",
                         dict(layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2,
                              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32), tolerance=FLOAT32),
    "Falcon-H1": Family("FalconH1ForCausalLM", "FalconH1Config",
                        dict(MAMBA, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_chunk_size=8)),
    "Jamba": Family("JambaForCausalLM", "JambaConfig",
                    dict(MAMBA, attn_layer_period=2, attn_layer_offset=1, mamba_dt_rank=4, num_experts=4,
                         num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                         use_mamba_kernels=False)),
    "Bamba": Family("BambaForCausalLM", "BambaConfig",
                    dict(MAMBA, mamba_n_heads=4, mamba_d_head=8, mamba_chunk_size=8, attn_layer_indices=[1]),
                    refused=r"BambaMixer at model\.layers\.0\.mamba: a recurrence"),
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


def _reference_kernels(starts):
    """transformers' mixer kernels as float64 loops over the whole sequence (``mixer_loops``), restarting where
    ``starts``: what transformers' own CPU fallbacks compute (they compute in float32 and run documents together)."""
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        assert activation in (None, "silu")
        y = loop_conv(hidden_states, weight, torch.zeros(len(weight)) if bias is None else bias, starts)
        return y if activation is None else torch.nn.functional.silu(y)

    def torch_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None,
                                     output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
        assert initial_state is None and not output_final_state
        query, key = (t.repeat_interleave(value.shape[-2] // key.shape[-2], dim=2) for t in (query, key))
        if use_qk_l2norm_in_kernel:
            query, key = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (query, key))
        return loop_linear(query, key, value, g, beta, starts, query.shape[-1] ** -0.5), None

    def mamba2_chunk_scan(hidden_states, dt, A, B, C, chunk_size, D=None, dt_bias=None, initial_states=None,
                          dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False, **kwargs):
        assert dt_softplus and tuple(dt_limit) == (0.0, float("inf")) and initial_states is None
        return loop_ssd(hidden_states, dt, A, B, C, D, dt_bias, starts)

    def mamba_selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                             return_last_state=False, **kwargs):
        assert delta_softplus and not return_last_state
        return loop_scan(hidden_states, dt, A, B, C, D, z, delta_bias, starts)

    return {"causal_conv1d_fn": causal_conv1d_fn, "torch_chunk_gated_delta_rule": torch_chunk_gated_delta_rule,
            "mamba2_chunk_scan": mamba2_chunk_scan, "mamba_selective_scan": mamba_selective_scan}


MODELING = ("lfm2", "qwen3_next", "falcon_h1", "jamba")  # transformers' modeling modules of the hybrids


@contextlib.contextmanager
def reference_kernels(length, documents=None):
    """The hybrid families' mixer kernels, while in the block, as float64 loops restarting at every document."""
    starts = np.isin(np.arange(length), [0] if documents is None else documents[:-1])
    kernels = _reference_kernels(starts)
    saved = []
    for family in MODELING:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        for name, kernel in kernels.items():
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, kernel)
    try:
        yield
    finally:
        for module, name, kernel in saved:
            setattr(module, name, kernel)


@contextlib.contextmanager
def float64_inside():
    """While in the block, what float64 models compute in float32 (``x.float()``, ``x.to(torch.float32)``: the
    RMSNorms of Qwen3-Next and Jamba, ``A_log.float()`` of the Mamba mixers) computes in float64: float32 rounds
    last-bit differences of a float64 tensor (from another order of summation, another rank count) to one float32
    ulp now and then, and sums parameter gradients of float32 casts per rank."""
    cast, to = torch.Tensor.float, torch.Tensor.to

    def as_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else cast(self, *args, **kwargs)

    def as_to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            kwargs = {k: torch.float64 if v is torch.float32 else v for k, v in kwargs.items()}
        return to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to = as_float, as_to
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = cast, to


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


def differences(comm, name, documents=None, layout="zigzag", inside64=False, **config):
    """Family ``name`` trained under mpiring.hf over ``comm`` (``layout``) and in one process with its reference:
    the largest |loss| and |parameter| differences, the same on every rank. ``inside64``: both runs in
    ``float64_inside()``; ``config``: fields of the family's config to set (``initializer_range=0.2``, ...)."""
    with float64_inside() if inside64 else contextlib.nullcontext():
        return _differences(comm, name, documents, layout, **config)


def _differences(comm, name, documents, layout, **config):
    from mpi4py import MPI

    torch.set_num_threads(1)
    ids = batch_ids()
    reference = build(name, FAMILIES[name].reference, **config)
    with mpiring.hf.ContextParallel(MPI.COMM_SELF, layout="contiguous") as one, reference_kernels(S, documents):
        want = train(reference, one, ids, documents)
    with mpiring.hf.ContextParallel(comm, layout=layout) as cp:
        model = build(name, "mpiring", **config)
        got = train(model, cp, ids, documents)
    loss = max(abs(a - b) for a, b in zip(got, want))
    params = max(float((p - r).detach().abs().max()) for p, r in zip(model.parameters(), reference.parameters()))
    return loss, params


if __name__ == "__main__":
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if sys.argv[1:] == ["--hybrids"]:
        for name in HYBRIDS:
            for layout, init, documents, inside in itertools.product(("zigzag", "contiguous"), (None, 0.2),
                                                                      (None, DOCUMENTS), (False, True)):
                config = {} if init is None else {"initializer_range": init}
                found = differences(comm, name, documents, layout, inside, **config)
                if comm.rank == 0:
                    print(f"P={comm.size} {name} {layout} init {init or 'default'} "
                          f"{'packed' if documents else 'one document'}{' float64 inside' if inside else ''}: "
                          f"loss {found[0]:.1e}, parameters {found[1]:.1e}", flush=True)
        sys.exit()
    for name in sys.argv[1:] or FAMILIES:
        for documents in (None, DOCUMENTS):
            try:
                text = "loss {:.1e}, parameters {:.1e}".format(*differences(comm, name, documents))
            except ValueError as exc:
                text = f"ValueError: {str(exc)[:150]}"
            if comm.rank == 0:
                print(f"P={comm.size} {name} ({'packed' if documents else 'one document'}): {text}", flush=True)
