"""mpiring: ring attention (context parallelism) on CPUs with real MPI and NumPy.

Planning, the cost model, the kernels, the references and the one-process
simulator need no MPI: ``import mpiring`` starts MPI only when an MPI-backed
name (``ring_attention``, ``distributed_attention``, ...) is first used, and
changes nothing else in the process (no environment variables: the run/
scripts set UCX's segment sizes where they start MPI, docs/mpi.md). The
submodules ``masks``, ``testing``, ``torch`` and ``hf`` are attributes too,
imported on first use (torch only for the last two).
"""

import importlib

from .core.backends import attention_block, attention_block_backward
from .core.kernels import merge
from .core.record import Record
from .core.reference import reference_attention, reference_attention_backward
from .core.tiles import release_workspace
from .cost.costmodel import predicted_backward_bytes, predicted_bytes_sent, ring_attention_context_parallel
from .plans.balancers import balance
from .plans.chunks import MixerSpec
from .plans.layouts import LAYOUTS, shard, shard_indices, unshard
from .plans.make import make_plan
from .plans.plan import MODES, Schedule, Task
from .plans.spec import Spec
from .plans.visibility import visible_keys
from .simulate import ring_attention_simulate, simulate

# MPI-backed names: module that defines each, imported on first use (PEP 562)
_LAZY = {
    "ring_attention": "handle", "ring_attention_backward": "handle", "Ring": "handle", "Lse": "core.lse",
    "distributed_attention": "distributed", "distributed_attention_backward": "distributed",
    "CommTimeout": "mpi.waits", "decode_attention": "decode", "KVCache": "kvcache",
    "decode_many": "decode", "attend_many": "kvcache", "HelixGrid": "helix", "helix_attention": "helix",
    "select_topk": "parallel.topk", "mla_attention": "parallel.latent", "mla_attention_backward": "parallel.latent",
    "causal_conv": "parallel.mixing.entry", "causal_conv_backward": "parallel.mixing.entry",
    "linear_attention": "parallel.mixing.entry", "linear_attention_backward": "parallel.mixing.entry",
    "ssd": "parallel.mixing.statespace", "ssd_backward": "parallel.mixing.statespace",
    "selective_scan": "parallel.mixing.statespace", "selective_scan_backward": "parallel.mixing.statespace",
    # submodules reachable as attributes (``mpiring.masks.causal()``); torch and hf import torch
    "masks": "masks", "testing": "testing", "torch": "torch", "hf": "hf",
}

__all__ = [
    "ring_attention", "distributed_attention", "Record", "CommTimeout", "Ring", "Lse", "decode_attention", "KVCache",
    "decode_many", "attend_many", "HelixGrid", "helix_attention", "select_topk",
    "mla_attention", "mla_attention_backward",
    "ring_attention_backward", "distributed_attention_backward", "predicted_backward_bytes",
    "attention_block_backward", "reference_attention_backward",
    "ring_attention_simulate", "simulate",
    "ring_attention_context_parallel", "predicted_bytes_sent",
    "attention_block", "merge", "reference_attention", "visible_keys",
    "LAYOUTS", "shard", "shard_indices", "unshard",
    "MODES", "Schedule", "Task", "make_plan", "balance", "release_workspace", "Spec",
    "causal_conv", "causal_conv_backward", "linear_attention", "linear_attention_backward", "ssd", "ssd_backward",
    "selective_scan", "selective_scan_backward", "MixerSpec",
]
__version__ = "0.1.0"


def __getattr__(name):
    if name in _LAZY:
        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        value = module if _LAZY[name] == name else getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
