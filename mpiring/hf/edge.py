"""The model edge of ``mpiring.hf``: what in a model mixes tokens along the sequence, and how mpiring runs it.

``inspect(model)`` walks a model once (``ContextParallel`` does it at the
model's first attention call, or in ``prepare``): every module that mixes
tokens is found by type, by the transformers attention interface its class
calls, or by the name of its kind (``MIXERS``); every config field that
changes attention is read (``layer_types`` and its kin through
``LAYER_TYPES``, ``attention_chunk_size``, temperature tuning). What mpiring
runs exactly is mapped (an attention layer becomes a ``Site``); anything else
is refused by name. A recurrence or a convolution run on each rank's shard
alone is exact at P = 1 only, so those refusals apply at P > 1; a mapping
problem (an attention pattern mpiring does not have) applies at every P.

``MIXERS`` is the table: a kind of sequence mixer, how it is recognised, and
how mpiring runs it (a function returning the mapping, or why not) or why it
cannot (a sentence). Mapping a new kind is one entry's ``run``.
"""

import dataclasses
import functools
import inspect as source
import sys
import types

import torch

__all__ = ["Mixer", "MIXERS", "LAYER_TYPES", "Site", "inspect", "calling_model", "entry_problem", "arm",
           "GENERATION"]

GENERATION = ("generation under context parallelism is not supported by mpiring.hf (use_cache=True, "
              "past_key_values or model.generate: a cache would hold only this rank's tokens). Generate in one "
              'process: on one rank, model.set_attn_implementation("sdpa") and model.generate(input_ids) with the '
              "whole prompt; or serve with mpiring's KVCache (docs/inference.md)")
RECURRENCE = ("a recurrence along the sequence: each rank's state would start from zero, not from the state the "
              "previous ranks' tokens leave (passing it between ranks as a scan is not mapped yet)")
CONVOLUTION = ("a convolution along the sequence: each rank's first tokens would miss the previous rank's last "
               "kernel - 1 tokens (a halo exchange is not mapped yet)")
OUTSIDE = ("attention computed by the module itself, not through transformers' attention interface "
           "(attn_implementation): each rank would attend to its own tokens only")
CONVOLUTIONS = (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d,
                torch.nn.ConvTranspose3d)
HYBRID = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}
CONTAINERS = ("layer", "block", "model", "forcausallm", "stack", "decoder", "encoder", "backbone")


@dataclasses.dataclass(frozen=True)
class Mixer:
    """A kind of sequence mixer: ``matches(module, name)`` (``name``: the class name, lower case, without the
    model family's prefix; None for containers such as decoder layers and for torch's own layers); ``run``: a
    function ``(module, label, cp) -> mapping`` that sets the module up to run exactly under the
    ``ContextParallel`` ``cp`` (the mapping has a ``how`` text) or returns why not (a str), or a str: why mpiring
    cannot run it on shards. A mapped layer finds each forward's context (sequence, documents, ``cp``) as the
    ``mpiring`` keyword of the model's call (``calling_model()``)."""

    kind: str
    matches: object
    run: object


def _named(*parts, classes=(), test=None):
    """Matches modules whose name holds one of ``parts``, or which are one of ``classes`` (and pass ``test``)."""
    def matches(module, name):
        if isinstance(module, classes) and (test is None or test(module)):
            return True
        return name is not None and any(p in name for p in parts)
    return matches


@functools.lru_cache(maxsize=None)
def calls_interface(cls) -> bool:
    """Whether a module class (not a whole model) calls transformers' attention interface (the code of its own
    methods, or of its base classes', names ``ALL_ATTENTION_FUNCTIONS``)."""
    if _is_model(cls):
        return False
    for c in cls.__mro__:
        if c.__module__.split(".")[0] in ("torch", "builtins"):
            continue
        try:
            if "ALL_ATTENTION_FUNCTIONS" in source.getsource(c):
                return True
        except (OSError, TypeError):
            pass
    return False


@dataclasses.dataclass(frozen=True)
class Site:
    """An attention layer mpiring runs: its path, its ``layer_types`` entry, the chunk size of a chunked layer
    (its chunks become documents of the layer's Ring) and the ``floor_scale`` of attention temperature tuning
    (Llama 4's NoPE layers scale queries by the index of each token in the rank's shard)."""

    path: str
    layer_type: str | None = None
    chunk: int | None = None
    floor_scale: float | None = None
    window: str | None = None  # what says the layer has a sliding window: its calls must pass it

    @property
    def how(self):
        extra = [f"chunks of {self.chunk} as documents"] if self.chunk else []
        extra += [f"temperature tuning exact while S < floor_scale={self.floor_scale} or P = 1"] \
            if self.floor_scale else []
        return "mpiring's ring attention" + (f" ({', '.join(extra)})" if extra else "")

    def problem(self, seq_len, size, sliding_window):
        """Why this call of the layer cannot be run exactly, or None (the same on every rank)."""
        if self.window and sliding_window is None:
            return (f"{self.path}: {self.window} but the call passes no sliding_window (transformers' mask has "
                    f"the window; mpiring would attend to every earlier token)")
        if self.layer_type in ("full_attention", "chunked_attention") and sliding_window is not None:
            return f"{self.path}: layer type {self.layer_type!r} but the call passes sliding_window={sliding_window}"
        if self.floor_scale is not None and size > 1 and seq_len >= self.floor_scale:
            return (f"{self.path}: attn_temperature_tuning=True (floor_scale={self.floor_scale}) scales its queries "
                    f"by each token's index within this rank's shard, not its position in the sequence (transformers "
                    f"counts from 0 in every forward), which differs once the sequence ({seq_len} tokens) reaches "
                    f"floor_scale at P > 1: set attn_temperature_tuning=False, or keep sequences shorter than "
                    f"floor_scale")
        return None


def _attention(module, path, cp=None):
    """The Site of a module that calls the attention interface, or why mpiring cannot map it."""
    config = getattr(module, "config", None)
    layer_types, index = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    layer_type = layer_types[index] if layer_types and isinstance(index, int) and index < len(layer_types) else None
    layer_type = HYBRID.get(layer_type, layer_type)  # the attention beside a state-space mixer (Falcon-H1, ...)
    if layer_type not in (None, "full_attention", "sliding_attention", "chunked_attention"):
        return f"{path}: layer_types[{index}]={layer_type!r} is an attention pattern mpiring.hf does not map"
    chunk = getattr(config, "attention_chunk_size", None) if layer_type == "chunked_attention" else None
    if layer_type == "chunked_attention" and not chunk:
        return f"{path}: layer type 'chunked_attention' without an attention_chunk_size"
    floor = None
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        floor = getattr(module, "floor_scale", None)
    elif getattr(config, "attn_temperature_tuning", False) and not hasattr(module, "attn_temperature_tuning"):
        return f"{path}: attn_temperature_tuning=True on an attention class mpiring.hf does not know it for"
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    window = ("layer type 'sliding_attention'" if layer_type == "sliding_attention" else
              f"config sliding_window={window}" if window and not layer_types else None)
    return Site(path, layer_type, chunk, floor, window)


MIXERS = (
    Mixer("attention", lambda module, name: calls_interface(type(module)), _attention),
    Mixer("linear attention", _named("gateddelta", "deltanet", "linearattention", "lightningattention",
                                     "retention", "rwkv", "hgrn"), RECURRENCE),
    Mixer("state space", _named("mamba", "mixer", "ssm", "hyena"), RECURRENCE),
    Mixer("recurrent", _named("recurrent", "rglru", "lstm", classes=(torch.nn.RNNBase,)), RECURRENCE),
    Mixer("convolution", _named("conv", classes=CONVOLUTIONS, test=lambda m: any(k > 1 for k in m.kernel_size)),
          CONVOLUTION),
    Mixer("attention outside the interface", _named("attention", "attn", classes=(torch.nn.MultiheadAttention,)),
          OUTSIDE),
)
BY_KIND = {m.kind: m for m in MIXERS}
# transformers' layer types (and Jamba's, RecurrentGemma's): the kind of mixer each names; None: token-local
LAYER_TYPES = {"full_attention": "attention", "sliding_attention": "attention", "chunked_attention": "attention",
               "attention": "attention", "conv": "convolution", "linear_attention": "linear attention",
               "mamba": "state space", "hybrid": "state space", "hybrid_sliding": "state space",
               "recurrent": "recurrent", "moe": None, "mlp": None, "dense": None, "sparse": None}
LAYER_TYPE_FIELDS = ("layer_types", "layers_block_type", "block_types")


def _name(module, prefixes):
    """The class name, lower case, without its family prefix; None for a container (a decoder layer, a model) and
    for torch's own layers (judged by their type)."""
    if type(module).__module__.startswith("torch."):
        return None
    name = type(module).__name__
    for prefix in prefixes:
        if name.startswith(prefix) and len(name) > len(prefix):
            name = name[len(prefix):]
            break
    name = name.lower()
    return None if name.endswith(CONTAINERS) else name


def inspect(model, cp=None, allow_unsharded=()):
    """Walk ``model`` for the ``ContextParallel`` ``cp`` (which mappings may keep): ``(mapped, rows, local,
    everywhere)``: the mapping of every module mpiring runs (an attention layer's ``Site``), one row ``(path,
    class, kind, how)`` per sequence mixer, the refusals of layers exact only at P = 1 (run on each rank's shard
    alone) and the problems at every P."""
    configs = {id(c): c for c in (getattr(m, "config", None) for m in model.modules()) if hasattr(c, "to_dict")}
    prefixes = sorted({type(c).__name__.removesuffix("Config") for c in configs.values()}, key=len, reverse=True)
    mapped, rows, refused, everywhere, claimed = {}, [], {}, [], []
    for path, module in model.named_modules():
        if any(path.startswith(c) for c in claimed):
            continue
        name = _name(module, prefixes)
        mixer = next((m for m in MIXERS if m.matches(module, name)), None)
        if mixer is None:
            continue
        cls = type(module).__name__
        if isinstance(mixer.run, str):
            by_class = refused.setdefault(mixer.run, {})  # found: its layer types need no refusal of their own
            if path in allow_unsharded or cls in allow_unsharded:
                rows.append((path, cls, mixer.kind, "allowed unsharded: each rank's shard alone"))
            else:
                by_class.setdefault(cls, []).append(path)
                rows.append((path, cls, mixer.kind, "each rank's shard alone: exact at P = 1, refused at P > 1"))
        else:
            how = mixer.run(module, f"{path or 'the model'} ({cls})", cp)
            if not isinstance(how, str):
                mapped[module] = how
                rows.append((path, cls, mixer.kind, how.how))
                continue
            everywhere.append(how)
        claimed.append(f"{path}." if path else "")
    fields = [p for c in configs.values() for p in _field_problems(c, refused, everywhere)]
    local = [f"{_listed(f'{cls} at ' + ', '.join(paths))}: {why}" for why, by in refused.items()
             for cls, paths in by.items()]
    return mapped, rows, local + list(dict.fromkeys(fields)), list(dict.fromkeys(everywhere))


def _listed(text, limit=160):
    """``text`` cut to ``limit`` characters at a comma."""
    return text if len(text) <= limit else text[:text.rfind(", ", 0, limit)] + ", ..."


def _field_problems(config, refused, everywhere):
    """Refusals of the layers a config's layer types name, where no module was found for the same reason; mapping
    problems of the config's attention fields go to ``everywhere``."""
    local = []
    for field in LAYER_TYPE_FIELDS:
        found = {}
        for i, layer_type in enumerate(getattr(config, field, None) or ()):
            found.setdefault(layer_type, []).append(i)
        for layer_type, where in found.items():
            at = f"layers {where} of type {layer_type!r} ({field})"
            if layer_type not in LAYER_TYPES:
                everywhere.append(f"{at}: a layer type mpiring.hf does not map")
                continue
            mixer = BY_KIND.get(LAYER_TYPES[layer_type])
            if mixer is not None and isinstance(mixer.run, str) and mixer.run not in refused:
                local.append(f"{at}: {mixer.run}")
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk and "chunked_attention" not in (getattr(config, "layer_types", None) or ()):
        everywhere.append(f"attention_chunk_size={chunk} without 'chunked_attention' in layer_types: mpiring.hf "
                          f"does not know which layers attend in chunks")
    return local


_CALLS = (torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__)


def calling_model():
    """The outermost module whose forward is running (the model the user called) and its call's keywords: the
    ``self`` of the outermost frame of ``Module.__call__`` on the stack."""
    found, frame = (None, {}), sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALLS:
            found = frame.f_locals.get("self"), frame.f_locals.get("kwargs") or {}
        frame = frame.f_back
    return found


def runs_mpiring(model):
    """Whether ``model``'s attention implementation is mpiring.hf's."""
    from transformers import AttentionInterface

    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return isinstance(impl, str) and getattr(AttentionInterface().get(impl), "__module__", None) == "mpiring.hf"


def entry_problem(model, kwargs):
    """Why a call of ``model`` (its keywords) cannot run under context parallelism, or None."""
    if kwargs.get("use_cache") or kwargs.get("past_key_values") is not None:
        return GENERATION
    if kwargs.get("mpiring") is None:
        return ('attn_implementation="mpiring" needs its context at every call: run the model as '
                "model(**batch.inputs) with batch = ContextParallel.shard(...) (the mpiring= keyword)")
    if "use_cache" not in kwargs and getattr(getattr(model, "config", None), "use_cache", False):
        return f"use_cache is not given and the model's config.use_cache is True: {GENERATION}"
    return None


def _entry(model, args, kwargs):
    """Forward pre-hook of an inspected model: refuse a call mpiring cannot run before any layer runs."""
    problem = entry_problem(model, kwargs) if runs_mpiring(model) else None
    if problem:
        raise ValueError(problem)


def _generate(model, *args, **kwargs):
    """``generate`` of an inspected model: refused while its attention is mpiring's, transformers' otherwise."""
    if runs_mpiring(model):
        raise ValueError(GENERATION)
    return type(model).generate(model, *args, **kwargs)


def _is_model(cls):
    """Whether ``cls`` is a transformers model class (a ``PreTrainedModel``), not one of a model's layers."""
    return any(c.__name__ == "PreTrainedModel" for c in cls.__mro__)


def arm(model):
    """Make the transformers models in an inspected ``model`` refuse what mpiring cannot run from their next call
    on: a forward with a cache or without the context, and ``generate`` (while their attention is mpiring's)."""
    for module in model.modules():
        if not _is_model(type(module)) or getattr(module, "_mpiring_armed", False):
            continue
        module.register_forward_pre_hook(_entry, with_kwargs=True)
        if callable(getattr(module, "generate", None)):
            module.generate = types.MethodType(_generate, module)  # a method: a deep copy rebinds it to the copy
        module._mpiring_armed = True
