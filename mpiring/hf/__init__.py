"""mpiring as a Hugging Face transformers attention implementation, and the rest of a context-parallel step.

    mpiexec -n 4 python examples/train_hf.py

    cp = mpiring.hf.ContextParallel(comm, layout="zigzag")      # registers attn_implementation "mpiring"
    model = LlamaForCausalLM._from_config(config, attn_implementation="mpiring")
    batch = cp.shard(input_ids, documents=[0, 300, 512])       # this rank's tokens, positions, shifted labels
    logits = model(**batch.inputs).logits                        # the ring runs inside every attention layer
    loss = cp.loss(logits, batch)                                # this rank's share of the global token mean
    loss.backward()                                              # the backward rings run here
    cp.all_reduce_gradients(model)                               # summed over ranks: the whole batch's gradient

Every rank holds the whole batch (``input_ids`` of shape ``(B, S)``) and
keeps its own tokens; the labels are shifted on the whole sequence before
sharding (a document's last token predicts nothing). The attention function
reads what transformers passes (``scaling``, ``is_causal``,
``sliding_window``, ``softcap``, ``s_aux`` (sinks), ``dropout``, the attention
mask) and maps each to mpiring's options, or raises naming the argument. The
model's first attention call inspects the whole model (``mpiring.hf.edge``):
every layer that mixes tokens and every config field that changes attention
is mapped (chunked attention, sliding windows, ...) or refused by name on
every rank before any step; the model then refuses a cache and ``generate``.
No module state: the ``ContextParallel`` object travels with each call as the
``mpiring=`` keyword of ``batch.inputs``, and keeps the ``Ring`` handles, one
per (sequence length, documents, scale, causal, window), so a loop over
varying lengths never rebuilds one it has (the oldest is closed beyond
``max_rings``).
"""

import dataclasses
import functools
import weakref
from collections import OrderedDict

import numpy as np
import torch

from .. import torch as mpiring_torch
from ..handle import Ring
from ..mpi.agree import agree, check_comm
from ..plans.call_options import RING_OPTIONS, foreign_problem
from ..plans.layouts import shard_indices
from . import edge

__all__ = ["ContextParallel", "Batch", "register", "NAME"]

NAME = "mpiring"
IGNORE = -100  # transformers' ignore_index


def padding_mask(*args, attention_mask=None, **kwargs):
    """transformers' mask function for ``attn_implementation="mpiring"``: nothing to build (mpiring makes its
    masks from the options), but a padding mask is handed on, so the attention refuses it instead of ignoring it.
    Called before the model's first layer: the model is inspected here at its first call (its sequence mixers
    mapped before they run)."""
    call = edge.calling_model()[1].get("mpiring")
    if isinstance(call, _Call):
        call.cp.called()
    if attention_mask is None or (attention_mask.dtype == torch.bool and bool(attention_mask.all())):
        return None
    return attention_mask


def register(name: str = NAME):
    """Register ``attention`` (and ``padding_mask``) with transformers under ``name``; repeating it is harmless."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, padding_mask)
    _guard_generate()


def _guard_generate():
    """Make transformers' ``generate`` refuse, on every rank and before it checks its arguments, a model whose
    attention is mpiring's (a cache would hold one rank's tokens), whether or not the model has run yet."""
    from transformers import GenerationMixin

    original = GenerationMixin.generate
    if getattr(original, "mpiring_guard", False):
        return

    @functools.wraps(original)
    def generate(model, *args, **kwargs):
        if edge.runs_mpiring(model):
            raise ValueError(edge.GENERATION)
        return original(model, *args, **kwargs)

    generate.mpiring_guard = True
    GenerationMixin.generate = generate


def attention(module, query, key, value, attention_mask, *, mpiring=None, **kwargs):
    """The attention function transformers calls: ``query`` ``(B, Hq, n, D)``, key and value ``(B, Hk, n, D)``
    (this rank's n tokens), returns ``((B, n, Hq, D), None)``. ``kwargs``: the layer's (``Called``)."""
    problem = edge.entry_problem(None, {"mpiring": mpiring, "use_cache": kwargs.get("use_cache")})
    if problem:
        raise ValueError(problem)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):  # flash-attn's packed documents: shard(documents=) says them
        given = kwargs.get(name)
        if given is not None and [int(e) for e in given] != list(mpiring.cu_seqlens or (0, mpiring.seq_len)):
            raise ValueError(f"{name}={[int(e) for e in given]} differs from the documents given to shard() "
                             f"({None if mpiring.cu_seqlens is None else list(mpiring.cu_seqlens)}): give the "
                             f"document boundaries (global positions) to ContextParallel.shard(documents=)")
    return mpiring.attend(module, query, key, value, attention_mask, Called.of(kwargs))


@dataclasses.dataclass(frozen=True)
class Called:
    """What an attention layer passes transformers' attention function that mpiring maps, by name."""

    scaling: float | None = None
    dropout: float = 0.0
    is_causal: bool | None = None
    sliding_window: int | None = None
    softcap: float | None = None  # Gemma2's attn_logit_softcapping
    s_aux: object = None  # gpt-oss's trained sinks

    @classmethod
    def of(cls, kwargs):
        return cls(**{f.name: kwargs[f.name] for f in dataclasses.fields(cls) if f.name in kwargs})


@dataclasses.dataclass
class Batch:
    """This rank's part of a batch: ``inputs`` go to the model (``model(**batch.inputs)``), the rest to the loss."""

    input_ids: torch.Tensor  # (B, n): this rank's tokens
    position_ids: torch.Tensor  # (B, n): global positions, or restarting in every document
    shift_labels: torch.Tensor  # (B, n): the next token of each, shifted on the whole sequence; -100: none
    positions: np.ndarray  # (n,): this rank's global token positions (mpiring.shard_indices)
    tokens: int  # labelled tokens of the whole batch (the loss's denominator), the same on every rank
    inputs: dict  # input_ids, position_ids, use_cache=False and mpiring= (this call's context)


class _Call:
    """One forward's context: the sequence it belongs to; attention layers get their Ring from it."""

    def __init__(self, cp, seq_len, cu_seqlens, positions):
        self.cp, self.seq_len, self.cu_seqlens = cp, seq_len, cu_seqlens
        self.positions = positions  # (S,): every token's position id (global, or within its document)
        self.attended = 0  # attention calls served

    def documents(self, chunk):
        """The Ring's documents of a layer attending in chunks of ``chunk`` position ids (transformers' chunked
        attention: key j visible to query i iff both are in one chunk of one document), or of any other layer."""
        if chunk is None:
            return self.cu_seqlens
        starts = np.flatnonzero(self.positions % chunk == 0).tolist()
        return tuple(sorted(set(starts) | set(self.cu_seqlens or ()) | {0, self.seq_len}))

    def attend(self, module, query, key, value, attention_mask, called):
        scaling, dropout, is_causal, softcap = called.scaling, called.dropout, called.is_causal, called.softcap
        sliding_window = called.sliding_window
        site = self.cp.site(module)  # the model inspected first, if no mask function call did it
        if attention_mask is not None:
            raise ValueError("attention_mask: padded batches are not supported by mpiring's attention (a padding "
                             "mask would be ignored); pack the rows into one and pass documents= to shard(), or "
                             "drop the padding (right padding in a causal model: labels -100 on the padding)")
        if dropout:
            raise ValueError(f"dropout={dropout}: attention dropout is not mapped by mpiring.hf (mpiring's dropout= "
                             f"draws from a seed fixed per Ring, and a training step needs a fresh one); build the "
                             f"model with attention_dropout=0.0")
        if query.shape[-2] != key.shape[-2]:
            raise ValueError(f"key holds {key.shape[-2]} tokens, the queries {query.shape[-2]} (a cache): "
                             f"{edge.GENERATION}")
        problem = site.problem(self.seq_len, self.cp.comm.Get_size(), sliding_window)
        if problem:
            raise ValueError(problem)
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        options = {"causal": causal, "scale": None if scaling is None else float(scaling)}
        if sliding_window is not None:  # transformers: key j visible iff j > i - sliding_window (and j <= i)
            if not causal:
                raise ValueError(f"sliding_window={sliding_window} without is_causal: mpiring maps transformers' "
                                 f"causal sliding windows only")
            options["window"] = (int(sliding_window) - 1, 0)
        if softcap is not None:
            options["softcap"] = float(softcap)
        call = {} if called.s_aux is None else {"sinks": called.s_aux}  # trained sinks: their gradient flows back
        ring = self.cp.ring(self.seq_len, self.documents(site.chunk), options)
        out = mpiring_torch.ring_attention(query, key, value, ring, **call)
        self.attended += 1
        return out.transpose(1, 2).contiguous(), None


# what ContextParallel gives every Ring itself, from the model's layers and the batch
SET_BY_THE_MODEL = dict.fromkeys(("comm", "seq_len", "seq_axis", "cu_seqlens", "causal", "scale", "window", "softcap"),
                                 "ContextParallel sets it from the model and the batch")


class ContextParallel:
    """Context parallelism for transformers models over ``comm``: every rank one device, one shard of each sequence.

    Args:
        comm: an mpi4py communicator (default COMM_WORLD).
        layout: which tokens each rank holds ("zigzag", "contiguous", "striped"; ``mpiring.shard_indices``).
        name: the ``attn_implementation`` to register ("mpiring").
        max_rings: Ring handles kept (one per sequence length, documents and attention options).
        allow_unsharded: module paths or class names of sequence layers that mpiring refuses (a convolution, a
            recurrence) to run anyway on each rank's shard alone: wrong at P > 1 if they mix tokens.
        ring_options: more options for every Ring (``mode=``, ``timeout=``, ``threads=``, ``wire_dtype=``, ...).
    """

    def __init__(self, comm=None, *, layout: str = "zigzag", name: str = NAME, max_rings: int = 8,
                 allow_unsharded=(), **ring_options):
        for option in ring_options:  # said now, not at the first forward's Ring
            if option in SET_BY_THE_MODEL or option not in RING_OPTIONS:
                raise ValueError(f"{option}= is no ring option of ContextParallel: "
                                 + SET_BY_THE_MODEL.get(option, foreign_problem(option, "see mpiring.Ring")))
        self.comm, self.layout, self.name = check_comm(comm), layout, name
        self.max_rings, self.ring_options = max_rings, ring_options
        self.allow_unsharded = tuple(allow_unsharded)
        self._rings = OrderedDict()
        self._sites = weakref.WeakKeyDictionary()  # module -> its mapping (an attention layer's edge.Site)
        self._models = weakref.WeakKeyDictionary()  # inspected model -> its rows
        register(name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Close every Ring handle kept."""
        while self._rings:
            self._rings.popitem(last=False)[1].close()

    def prepare(self, model):
        """Inspect ``model`` (collective; its first attention call does it otherwise): every sequence layer mapped,
        or a ValueError on every rank naming each layer and config field mpiring cannot run exactly at this P.
        Returns one row ``(path, class, kind, how mpiring runs it)`` per sequence layer. The model then refuses a
        forward with a cache or without the context, and ``generate``, while its attention is mpiring's."""
        return self._inspect(model)

    def _inspect(self, model, entry=None):
        """``prepare``, with what the first call's keywords make impossible (``entry``) agreed with the rest."""
        if model in self._models:
            return self._models[model]
        mapped, rows, local, everywhere = edge.inspect(model, self, self.allow_unsharded)
        size = self.comm.Get_size()
        problems = everywhere + (local if size > 1 else [])
        hatch = " (ContextParallel(allow_unsharded=[...]) would run such layers on each rank's shard alone)"
        problem = (f"mpiring.hf cannot run this model exactly at P={size}: " + "; ".join(problems)
                   + (hatch if local and size > 1 else "")) if problems else None
        agree(self.comm, entry or problem, self.ring_options.get("timeout", "auto"), entry=True)
        self._sites.update(mapped)
        self._models[model] = rows
        edge.arm(model)
        return rows

    def called(self):
        """Inspect the model being called (the outermost, ``edge.calling_model``) if it is new: whether it was."""
        model, kwargs = edge.calling_model()
        if model is None or model in self._models:
            return False
        self._inspect(model, edge.entry_problem(model, kwargs) if edge.runs_mpiring(model) else None)
        return True

    def mapping(self, module):
        """How this ContextParallel runs ``module`` (an attention layer's Site, a mixer layer's Layer), or None."""
        return self._sites.get(module)

    def site(self, module):
        """The Site of an attention module; the model it belongs to is inspected at its first call."""
        if module not in self._sites and self.called():
            model = edge.calling_model()[0]
            mixers = [m.path for m in map(self.mapping, model.modules()) if isinstance(m, edge.mixers.Layer)]
            if mixers:  # inspected only now: they ran in this forward unmapped (no mask function was called)
                raise ValueError(f"the sequence mixers at {', '.join(mixers)} ran before mpiring.hf inspected the "
                                 f"model: call ContextParallel.prepare(model) before its first step")
        if module not in self._sites:
            raise ValueError(f"an attention call from {type(module).__name__}, which the inspection of the model "
                             f"did not find: call the model itself (model(**batch.inputs)), or prepare(model) first")
        return self._sites[module]

    def ring(self, seq_len, cu_seqlens, options):
        """The Ring for a sequence of ``seq_len`` tokens with these documents and attention options (built on
        first use, collectively: every rank runs the same layers in the same order)."""
        key = (seq_len, cu_seqlens, tuple(sorted(options.items())))
        if key in self._rings:
            self._rings.move_to_end(key)
            return self._rings[key]
        if len(self._rings) >= self.max_rings:
            self._rings.popitem(last=False)[1].close()
        self._rings[key] = Ring(self.comm, seq_len, layout=self.layout, seq_axis="bhsd", **options,
                                cu_seqlens=None if cu_seqlens is None else list(cu_seqlens), **self.ring_options)
        return self._rings[key]

    def shard(self, input_ids, labels=None, *, documents=None, position_ids: str = "auto") -> Batch:
        """This rank's part of the whole batch ``input_ids`` ``(B, S)`` (the same on every rank).

        ``labels``: ``(B, S)``, default ``input_ids``; -100 marks tokens that are no target. They are shifted on
        the whole sequence (token t's target is label t + 1), then sharded. ``documents``: packed documents,
        ``[0, e1, ..., S]``: attention never crosses a boundary and a document's last token has no target.
        ``position_ids``: "global" (0..S-1), "document" (restarting at every document), or "auto": "document"
        when documents are given.
        """
        input_ids = torch.as_tensor(input_ids)
        labels = input_ids if labels is None else torch.as_tensor(labels)
        if input_ids.ndim != 2 or labels.shape != input_ids.shape:
            raise ValueError(f"input_ids must be (batch, seq) and labels the same shape, got "
                             f"{tuple(input_ids.shape)} and {tuple(labels.shape)}")
        S = input_ids.shape[1]
        shifted = torch.full_like(labels, IGNORE)
        shifted[:, :-1] = labels[:, 1:]
        starts = np.zeros(1, np.int64)
        cu = None
        if documents is not None:
            cu = tuple(int(e) for e in documents)
            if len(cu) < 2 or cu[0] != 0 or cu[-1] != S or any(b <= a for a, b in zip(cu, cu[1:])):
                raise ValueError(f"documents must rise strictly from 0 to the sequence length {S}, got {list(cu)}")
            shifted[:, np.asarray(cu[1:]) - 1] = IGNORE  # a document's last token predicts nothing of the next
            starts = np.asarray(cu[:-1])
        kind = ("document" if cu is not None else "global") if position_ids == "auto" else position_ids
        if kind not in ("global", "document"):
            raise ValueError(f'position_ids must be "global", "document" or "auto", got {position_ids!r}')
        every = np.arange(S)
        every = every - (starts[np.searchsorted(starts, every, side="right") - 1] if kind == "document" else 0)
        mine = shard_indices(S, self.comm.Get_size(), self.comm.Get_rank(), self.layout)
        rows = torch.as_tensor(mine)
        ids = input_ids[:, rows]
        pos = torch.as_tensor(every[mine]).expand(ids.shape[0], -1)
        inputs = {"input_ids": ids, "position_ids": pos, "use_cache": False, "mpiring": _Call(self, S, cu, every)}
        return Batch(ids, pos, shifted[:, rows], mine, int((shifted != IGNORE).sum()), inputs)

    def loss(self, logits, batch: Batch, tokens: int | None = None):
        """This rank's share of the batch's mean cross-entropy (its tokens' sum over the global count), in the
        logits' dtype: the shares add up to the single-process loss (``reduce``), their gradients to its.

        ``tokens``: the labelled tokens of the whole batch the mean is over, default ``batch.tokens``; with
        gradient accumulation, the sum of every micro-batch's ``tokens``, so that the micro-batches' gradients add
        up to the whole batch's. At P > 1, refused if no attention of the forward ran through mpiring (the model
        was not built with this attention implementation, or its calls lacked ``batch.inputs``' context)."""
        call = batch.inputs.get("mpiring")
        if self.comm.Get_size() > 1 and not getattr(call, "attended", 0):
            raise ValueError(f"no attention layer ran through mpiring in the forward that made these logits (P="
                             f"{self.comm.Get_size()}), so each rank's layers saw only its own tokens: build the "
                             f'model with attn_implementation="{self.name}" and run it as model(**batch.inputs)')
        return torch.nn.functional.cross_entropy(logits.flatten(0, -2), batch.shift_labels.flatten(),
                                                 ignore_index=IGNORE, reduction="sum") / max(tokens or batch.tokens, 1)

    def reduce(self, loss) -> float:
        """The sum over ranks of each rank's ``loss`` share: the batch's loss, the same on every rank."""
        from mpi4py import MPI

        return self.comm.allreduce(float(loss.detach() if torch.is_tensor(loss) else loss), op=MPI.SUM)

    def all_reduce_gradients(self, model):
        """Sum every parameter's gradient over the ranks, in place (one Allreduce per dtype; half precision
        is summed in float32): the gradient of the batch's loss, the same on every rank."""
        from mpi4py import MPI

        groups = {}
        for p in model.parameters():
            if p.grad is not None:
                groups.setdefault(p.grad.dtype, []).append(p.grad)
        for dtype, grads in groups.items():
            wire = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
            flat = torch.cat([g.reshape(-1).to(wire) for g in grads])
            self.comm.Allreduce(MPI.IN_PLACE, flat.numpy(), op=MPI.SUM)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
