"""The sequence mixers of hybrid models under ``mpiring.hf``: transformers' kernels bound to ``mpiring.torch``'s.

The mixer layers of LFM2, Qwen3-Next, Falcon-H1 and Jamba call kernel
functions of their modeling module by name (``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan``,
``mamba_selective_scan``): transformers binds those names to causal-conv1d,
fla or mamba_ssm where installed, to its torch fallbacks on the CPU. While
such a layer runs in a forward under ``ContextParallel`` (its call carries the
``mpiring=`` context), the names are bound to mpiring's adapters, which run
the convolution's halo and the state passing over the ranks with the call's
sequence, layout and documents (a document boundary restarts the state and
the convolution); the layer's own code does everything else. After the layer's
call the names are transformers' again: outside a cp forward the layer is
untouched. A padding mask, a cache or an option the adapters cannot run
(``initial_state``, an activation other than SiLU, ...) is refused by name.
"""

import dataclasses
import inspect
import sys
import weakref

from .. import torch as mt

__all__ = ["LAYERS", "Layer", "run", "bind"]


def _options(call, problem, kwargs):
    """The adapters' options for this rank's call (``call``: the forward's context): the sequence, layout and
    documents, and this rank's problem, if any (every rank raises it, through the adapter's agreement)."""
    cu = kwargs.get("cu_seqlens")
    if problem is None and cu is not None and [int(e) for e in cu] != list(call.cu_seqlens or (0, call.seq_len)):
        problem = (f"cu_seqlens={[int(e) for e in cu]} given to a sequence mixer differs from the documents given "
                   f"to shard() ({None if call.cu_seqlens is None else list(call.cu_seqlens)}): give the document "
                   f"boundaries (global positions) to ContextParallel.shard(documents=)")
    if problem is None and kwargs.get("seq_idx") is not None:
        problem = ("seq_idx given to a sequence mixer: mpiring.hf takes packed documents from "
                   "ContextParallel.shard(documents=) only")
    return {"comm": call.cp.comm, "seq_len": call.seq_len, "layout": call.cp.layout,
            "cu_seqlens": None if call.cu_seqlens is None else list(call.cu_seqlens),
            "timeout": call.cp.ring_options.get("timeout", "auto"), "problem": problem}


def _adapter(target, keywords=()):
    """The replacement of a kernel name: transformers' call goes to ``target`` (``mpiring.torch``'s adapter of the
    same positional signature) with the keywords it takes (its parameters and ``keywords``); the layer's other
    keywords are checked (``cu_seqlens``, ``seq_idx``) and dropped."""
    taken = {name for name, p in inspect.signature(target).parameters.items() if p.kind != p.VAR_KEYWORD}
    taken |= set(keywords)

    def bound(call, problem):
        def kernel(*args, **kwargs):
            theirs = {name: kwargs.pop(name) for name in list(kwargs) if name not in taken}
            return target(*args, **kwargs, **_options(call, problem, theirs))
        return kernel
    return bound


def _unfused(call, problem):
    def mamba2_split_conv1d_scan_combined(*args, **kwargs):
        return None  # as transformers' torch fallback: the layer then takes its unfused path, mapped above
    return mamba2_split_conv1d_scan_combined


KERNELS = {"causal_conv1d_fn": _adapter(mt.causal_conv1d),
           "torch_chunk_gated_delta_rule": _adapter(mt.chunk_gated_delta_rule),
           "mamba2_chunk_scan": _adapter(mt.mamba_chunk_scan, ("return_final_states", "z")),
           "mamba2_split_conv1d_scan_combined": _unfused, "mamba_selective_scan": _adapter(mt.selective_scan)}
# a mixer layer's class: the kind of mixer, and the kernels its forward calls by name in its modeling module
LAYERS = {"Lfm2ShortConv": ("convolution", ("causal_conv1d_fn",)),
          "Qwen3NextGatedDeltaNet": ("linear attention", ("causal_conv1d_fn", "torch_chunk_gated_delta_rule")),
          "FalconH1Mixer": ("state space", ("causal_conv1d_fn", "mamba2_split_conv1d_scan_combined",
                                            "mamba2_chunk_scan")),
          "JambaMambaMixer": ("state space", ("causal_conv1d_fn", "mamba_selective_scan"))}
FAMILIES = "LFM2, Qwen3-Next, Falcon-H1 and Jamba"
_BOUND = weakref.WeakKeyDictionary()  # a layer running under cp -> the names it replaced, to restore
_HOOKED = weakref.WeakSet()


@dataclasses.dataclass(frozen=True)
class Layer:
    """A mixer layer mpiring runs: its path and the kernel names bound to mpiring's adapters in its calls."""

    path: str
    kernels: tuple

    @property
    def how(self):
        return "mpiring's " + ", ".join(SAID[k] for k in self.kernels if k in SAID)


SAID = {"causal_conv1d_fn": "causal_conv1d (halo exchange)",
        "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule (state passing)",
        "mamba2_chunk_scan": "mamba_chunk_scan (state passing)",
        "mamba_selective_scan": "selective_scan (state passing)"}


def matches(kind):
    """The ``Mixer.matches`` of the layers of ``kind`` mpiring maps."""
    return lambda module, name: LAYERS.get(type(module).__name__, (None,))[0] == kind


def run(module, label, cp=None):
    """The ``Layer`` of a mixer layer (its calls under cp then go through mpiring), or why it cannot be mapped."""
    kernels = LAYERS[type(module).__name__][1]
    namespace = vars(sys.modules[type(module).__module__])
    missing = [name for name in kernels if not callable(namespace.get(name))]
    if missing:
        return (f"{label}: its module {type(module).__module__} has no {', '.join(missing)} (mpiring.hf binds "
                f"those kernel names to its own; a transformers version it does not know)")
    if module not in _HOOKED:
        module.register_forward_pre_hook(bind, with_kwargs=True)
        module.register_forward_hook(_restore, always_call=True)
        _HOOKED.add(module)
    return Layer(label, kernels)


def bind(module, args, kwargs):
    """Forward pre-hook: under a cp forward that mapped ``module``, its kernel names become mpiring's."""
    call = _context(kwargs)
    cp = getattr(call, "cp", None)
    if cp is None or not isinstance(cp.mapping(module), Layer):
        return
    padded = kwargs.get("attention_mask") is not None or len(args) > 2 and args[2] is not None
    problem = (f"{type(module).__name__}: a padding mask (attention_mask) is not supported by mpiring's sequence "
               f"mixers; pack the rows into one and pass documents= to shard()") if padded else None
    namespace = vars(sys.modules[type(module).__module__])
    kernels = LAYERS[type(module).__name__][1]
    _BOUND[module] = {name: namespace[name] for name in kernels}
    namespace.update({name: KERNELS[name](call, problem) for name in kernels})


def _context(kwargs):
    """The forward's context: the layer's own ``mpiring`` keyword, or the nearest caller's ``kwargs`` holding one
    (the model's call; a decoder layer's forward, which gradient checkpointing recomputes in the backward)."""
    if kwargs.get("mpiring") is not None:
        return kwargs["mpiring"]
    frame = sys._getframe(2)
    while frame is not None:
        found = frame.f_locals.get("kwargs")
        if isinstance(found, dict) and found.get("mpiring") is not None:
            return found["mpiring"]
        frame = frame.f_back
    return None


def _restore(module, args, output):
    """Forward hook (also after an error): the kernel names are transformers' again."""
    saved = _BOUND.pop(module, None)
    if saved:
        vars(sys.modules[type(module).__module__]).update(saved)
