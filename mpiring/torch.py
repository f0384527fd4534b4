"""Ring attention as a PyTorch autograd function, on CPU tensors (the optional ``torch`` extra).

    import mpiring, mpiring.torch
    ring = mpiring.Ring(comm, seq_len, causal=True, layout="zigzag", seq_axis=-3)  # (B, S, H, D) tensors
    out = mpiring.torch.ring_attention(q, k, v, ring)   # forward ring now
    loss.backward()                                      # backward ring when autograd reaches it

Tensors and NumPy arrays share memory both ways (``Tensor.numpy()``,
``torch.from_numpy``): nothing is copied on the way in or out, except what
the ring copies anyway to make a strided input contiguous. bfloat16, float16,
float32 and float64 tensors on the CPU (bfloat16 shares its memory as
``ml_dtypes.bfloat16``, the ``half`` extra). Half inputs compute their tiles
in float32 as the NumPy path does: out and the gradients come back in the
input dtype, lse in float32. Every rank must run the same graph: the backward of each
attention call is collective, as its forward is.
"""

import numpy as np
import torch

from .core.kernels import merge_weight
from .core.modifiers import TableBias
from .core.precision import named_dtype
from .handle import caller_found
from .handle import ring_attention as _ring_attention
from .handle import ring_attention_backward as _ring_attention_backward
from .mpi.agree import check_comm
from .parallel.mixing.entry import Refused
from .parallel.mixing.entry import causal_conv as _conv
from .parallel.mixing.entry import causal_conv_backward as _conv_backward
from .parallel.mixing.entry import linear_attention as _linear
from .parallel.mixing.entry import linear_attention_backward as _linear_backward
from .parallel.mixing.statespace import selective_scan as _scan
from .parallel.mixing.statespace import selective_scan_backward as _scan_backward
from .parallel.mixing.statespace import ssd as _ssd
from .parallel.mixing.statespace import ssd_backward as _ssd_backward
from .plans.axes import seq_index
from .plans.call_options import RING_OPTIONS, foreign_problem
from .plans.checks import Shown
from .plans.content import content

__all__ = ["ring_attention", "score_mod", "DTYPES", "causal_conv1d", "linear_attention", "chunk_gated_delta_rule",
           "mamba_chunk_scan", "selective_scan"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)  # bfloat16 through ml_dtypes
FUNCTION_OPTIONS = set(RING_OPTIONS) | {"comm", "record"}  # those of mpiring.ring_attention


def _numpy(t, name):
    """``(array, None)``: a tensor's memory as a NumPy array (no copy), or ``(None, why not)``."""
    if not isinstance(t, torch.Tensor):
        return None, f"{name} must be a torch.Tensor, got {type(t).__name__}"
    if t.device.type != "cpu":
        return None, f"{name} is on {t.device}: mpiring computes on the CPU; move it with .cpu() first"
    if t.dtype not in DTYPES:
        return None, (f"{name} is {t.dtype}: mpiring.torch takes bfloat16, float16, float32 and float64 CPU "
                      f"tensors; convert it with .float() or .double()")
    if t.dtype == torch.bfloat16:  # the same memory, seen as ml_dtypes' bfloat16
        try:
            return t.detach().view(torch.int16).numpy().view(named_dtype("bfloat16")), None
        except ValueError as exc:  # ml_dtypes is not installed
            return None, f"{name} is torch.bfloat16: {exc}"
    return t.detach().numpy(), None


def _tensor(a):
    """A NumPy array as a tensor sharing its memory (ml_dtypes' bfloat16 as torch.bfloat16)."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def _arrays(tensors, names):
    """The tensors as NumPy arrays and the first problem found (arrays None then)."""
    found = [_numpy(t, name) for t, name in zip(tensors, names)]
    problem = next((why for _, why in found if why), None)
    return [None if problem else a for a, _ in found], problem


class ScoreMod:
    """A flex_attention ``score_mod`` written in torch ops, as mpiring's NumPy ``score_mod`` (``__call__``) and its
    derivative (``grad``: torch autograd of the function, elementwise in the score)."""

    def __init__(self, fn):
        self.fn = fn

    def _args(self, s, b, h, qi, ki):  # torch wants writable arrays (index arrays may be read-only views)
        return [torch.from_numpy(np.require(a, requirements=("C", "W"))) for a in (s, b, h, qi, ki)]

    def __call__(self, s, b, h, qi, ki):
        with torch.no_grad():
            return self.fn(*self._args(s, b, h, qi, ki)).numpy()

    def grad(self, s, b, h, qi, ki):
        args = self._args(s, b, h, qi, ki)
        with torch.enable_grad():
            score = args[0].requires_grad_(True)
            (got,) = torch.autograd.grad(self.fn(score, *args[1:]).sum(), score, allow_unused=True)
        return np.zeros(s.shape) if got is None else got.numpy()


def score_mod(fn):
    """``{score_mod, score_mod_grad}`` of a flex_attention score_mod written in torch ops (``fn(score, batch, head,
    q_pos, k_pos)`` on broadcast tensors), its derivative by autograd: options for ``mpiring.Ring`` or a call."""
    mod = fn if isinstance(fn, ScoreMod) else ScoreMod(fn)
    return dict(score_mod=mod, score_mod_grad=mod.grad)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, options, problem, shared, table):
        arrays, found = _arrays((q, k, v), "qkv")
        with caller_found(problem or found, shared):  # reported by every rank, through the call's agreement
            if ring is not None:
                out, lse, *top = ring.forward(*arrays, **options)
            else:
                out, lse, *top = _ring_attention(*arrays, **options)
        out_t = _tensor(out)
        ctx.save_for_backward(q, k, v, out_t)
        ctx.ring, ctx.options, ctx.lse = ring, options, lse  # lse as returned: it carries the forward's options
        ctx.table_dtype = None if table is None else table.dtype
        ctx.set_materialize_grads(False)
        top = torch.from_numpy(top[0]) if top else torch.empty(0)  # the max logit, when asked for
        ctx.mark_non_differentiable(top)
        return out_t, _tensor(lse), top

    @staticmethod
    def backward(ctx, dout, dlse, _):
        q, k, v, out = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        arrays, problem = _arrays((dout, q, k, v, out), ("the gradient of out", "q", "k", "v", "out"))
        dlse, found = (None, None) if dlse is None else _numpy(dlse, "the gradient of lse")
        with caller_found(problem or found):
            if ctx.ring is not None:
                grads = ctx.ring.backward(*arrays, ctx.lse, dlse=dlse)
            else:
                grads = _ring_attention_backward(*arrays, ctx.lse, dlse=dlse, **ctx.options)
        dtable = None  # a trainable TableBias: this rank's share of d table (last), as for the sinks
        if ctx.needs_input_grad[7]:
            size = ctx.ring.size if ctx.ring is not None else check_comm(ctx.options.get("comm")).Get_size()
            dtable = torch.from_numpy(np.asarray(grads[-1]) / size).to(ctx.table_dtype)
        return (*(_tensor(g) for g in grads[:3]), None, None, None, None, dtable)  # the Ring's own sinks: no tensor


def _with_sinks(out, lse, sinks, ring, options):
    """Trainable sinks (gpt-oss): each head's logit joins every row's denominator once, in torch ops after the
    ring, so autograd gives d loss / d sinks, and the ring's backward gets the matching dout and dlse."""
    seq_axis = ring.seq_axis if ring is not None else options.get("seq_axis", -2)
    lse_f, shrink = merge_weight(lse, sinks.to(lse.dtype)[:, None].expand(lse.shape[-2:]), xp=torch)  # a 0 block
    shrink = shrink.unsqueeze(-1)  # (..., H, n, 1) in the ring's (..., H, n, D) order
    shrink = torch.movedim(shrink, -2, seq_index(seq_axis, out.ndim))
    return out * shrink.to(out.dtype), lse_f


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring=None, *, return_lse: bool = False,
                   sinks: torch.Tensor | None = None, **options):
    """Context-parallel attention of this rank's q, k, v tensors, differentiable.

    ``ring``: an ``mpiring.Ring`` (agreed once; ``options`` may repeat its own, as a model passes them at every
    call: a differing one raises ValueError on every rank), or None and ``options`` those of
    ``mpiring.ring_attention``, agreed at every call. An option mpiring does not have (``attn_mask``, ...) or a
    tensor it cannot take raises ValueError on every rank. Returns ``out``, or ``(out, lse)`` with
    ``return_lse=True`` (lse's gradient enters the backward as ``delta - dlse``), then the max logit with
    ``return_max_logit=True`` (not differentiable). ``sinks`` (one logit per query head, gpt-oss), a ``score_mod``
    in torch ops and a ``TableBias`` whose table is a tensor train through autograd (docs/masks.md): each rank's
    gradient is its share, all-reduced with the replicated parameters' (``mpiring.hf.all_reduce_gradients``).
    """
    unknown = [name for name in options if name not in FUNCTION_OPTIONS]
    problem = foreign_problem(unknown[0], "the options of a Ring go to mpiring.Ring(...)" if ring is not None else
                              "without a Ring, this call takes those of mpiring.ring_attention") if unknown else None
    options = {name: value for name, value in options.items() if name not in unknown}
    if sinks is not None and problem is None:
        problem = _sinks_problem(sinks, q, ring, options)
    if options.get("score_mod") is not None and options.get("score_mod_grad") is None:
        options.update(score_mod(options["score_mod"]))  # torch ops: the derivative by autograd
    spec = ring.spec if ring is not None else options.get("spec")  # a table given in a spec trains too
    bias = options.get("bias") if ring is None and options.get("bias") is not None else getattr(spec, "bias", None)
    table = bias.table if isinstance(bias, TableBias) and isinstance(bias.table, torch.Tensor) else None
    out, lse, top = _RingAttention.apply(q, k, v, ring, options, problem, _shared(q, k, v, sinks, problem), table)
    if sinks is not None:
        out, lse = _with_sinks(out, lse, sinks, ring, options)
    results = (out, lse) if return_lse else (out,)
    results += (top,) if top.numel() else ()
    return results if len(results) > 1 else out


def _shared(q, k, v, sinks, problem):
    """What every rank's call must have alike beside the arrays: whether a backward follows (autograd calls it on
    the ranks whose output needs a gradient: all or none), and the trainable sinks, by content."""
    tensors = [t for t in (q, k, v, sinks) if isinstance(t, torch.Tensor)]
    shared = {"requires_grad": Shown(torch.is_grad_enabled() and any(t.requires_grad for t in tensors))}
    if sinks is not None and problem is None:
        shared["sinks tensor"] = Shown(None, f"{sinks.dtype} ({len(sinks)},)", content(sinks.detach(), "sinks tensor"))
    return shared


def _sinks_problem(sinks, q, ring, options):
    """Why a call's trainable ``sinks`` cannot be used, or None."""
    if not isinstance(sinks, torch.Tensor) or sinks.ndim != 1 or not sinks.is_floating_point():
        return f"sinks must be a 1-D floating-point tensor of one logit per query head, got {sinks!r:.80}"
    if not bool(torch.isfinite(sinks.detach()).all()):
        bad = int((~torch.isfinite(sinks.detach())).sum())
        return f"sinks must be finite logits, one per query head; got {bad} NaN/Inf of {len(sinks)}"
    if (ring is not None and ring.spec.sinks is not None) or options.get("sinks") is not None:
        return "sinks are given twice: as the Ring's (or an option's) fixed logits and as the call's tensor"
    seq_axis = ring.seq_axis if ring is not None else options.get("seq_axis", -2)
    try:
        shape = list(q.shape)
        shape.insert(len(shape) - 1, shape.pop(seq_index(seq_axis, q.ndim)))  # the sequence on axis -2
    except (TypeError, ValueError):
        return None  # the call's own check names the bad axis
    heads = shape[-3] if len(shape) > 2 else 1
    if len(sinks) != heads:
        return f"sinks has {len(sinks)} logits, but q has {heads} query heads: give one per head"
    return None


# ---------------------------------------------------------------- the sequence mixers (docs/mixers.md)
#
# Each takes what the transformers kernel it is named after takes (the same shapes and pointwise steps, in torch
# ops), plus a mixer call's keywords (comm=, timeout=, record=, spec= or MixerSpec's options; problem=: this
# rank's reason the call cannot run, raised by every rank through the call's agreement).

MIXERS = {"conv": (_conv, _conv_backward, "dy"), "linear": (_linear, _linear_backward, "dout"),
          "ssd": (_ssd, _ssd_backward, "dy"), "scan": (_scan, _scan_backward, "dy")}


def _mixer_arrays(named):
    """NumPy views of the tensors (None kept; a Refused where a tensor cannot be one: every rank hears why)."""
    out = {}
    for name, t in named.items():
        a, why = (None, None) if t is None else _numpy(t, name)
        out[name] = Refused(why) if why else a
    return out


class _Mixer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kind, names, keywords, refused, *tensors):
        arrays = _mixer_arrays(dict(zip(names, tensors)))
        if refused:  # what the adapter could not map, reported by every rank through the call's agreement
            arrays[names[0]] = Refused(refused)
        result = MIXERS[kind][0](**arrays, **keywords)
        out, ctx.carry = (result, None) if kind == "conv" else result
        ctx.kind, ctx.names, ctx.keywords = kind, names, keywords
        ctx.save_for_backward(*tensors)
        return _tensor(out)

    @staticmethod
    def backward(ctx, dout):
        _, backward, dname = MIXERS[ctx.kind]
        arrays = _mixer_arrays({dname: dout, **dict(zip(ctx.names, ctx.saved_tensors))})
        carry = {} if ctx.kind == "conv" else {"carry": ctx.carry}
        grads = backward(**arrays, **carry, **ctx.keywords)
        return (None, None, None, None, *(None if g is None else _tensor(g) for g in grads))


def _refused(**given):
    """Why an option the transformers kernel takes cannot be run by mpiring (name and value), or None."""
    for name, (value, allowed) in given.items():
        if value not in allowed:
            return f"{name}={value!r} is not supported by mpiring's sequence mixers (supported: {allowed})"
    return None


def causal_conv1d(x, weight, bias=None, activation=None, **mixer):
    """transformers' ``causal_conv1d_fn``: x (B, C, n) this rank's tokens, weight (C, w), bias (C,) or None;
    ``activation`` None or "silu". Returns (B, C, n)."""
    refused = mixer.pop("problem", None) or _refused(activation=(activation, (None, "silu", "swish")))
    y = _Mixer.apply("conv", ("x", "weight", "bias"), mixer, refused, x.transpose(-1, -2), weight, bias)
    y = y.transpose(-1, -2).contiguous()  # contiguous as transformers' is: layers call .view() on it
    return y if activation is None else torch.nn.functional.silu(y)


def _l2norm(x, eps=1e-6):
    """transformers' (and FLA's) l2norm: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def linear_attention(q, k, v, g=None, *, beta=None, scale=None, **mixer):
    """Linear attention with a decay, (B, n, H, d) tensors as flash-linear-attention takes them: ``g`` None,
    (B, n, H) log decays (one per head) or (B, n, H, dk) (GLA); ``beta`` (B, n, H): the gated delta rule.
    Returns (B, n, H, dv)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    refused = mixer.pop("problem", None)
    out = _Mixer.apply("linear", ("q", "k", "v", "decay", "beta"), dict(mixer, scale=scale), refused,
                       *(None if t is None else t.transpose(1, 2) for t in (q, k, v, g, beta)))
    return out.transpose(1, 2).contiguous()


def chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, *, scale=None, **mixer):
    """transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next): query, key (B, n, Hk, dk), value (B, n, Hv, dv),
    g and beta (B, n, Hv); Hv a multiple of Hk (each q/k head serves Hv / Hk consecutive value heads). Returns
    ``(out (B, n, Hv, dv), None)``. ``chunk_size`` is transformers' block (mpiring's is ``block=``)."""
    refused = mixer.pop("problem", None) or _refused(initial_state=(initial_state, (None,)),
                                                     output_final_state=(output_final_state, (False,)))
    if value.shape[-2] != key.shape[-2]:
        query, key = (t.repeat_interleave(value.shape[-2] // key.shape[-2], dim=2) for t in (query, key))
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    return linear_attention(query, key, value, g, beta=beta, scale=scale, problem=refused, **mixer), None


def mamba_chunk_scan(hidden_states, dt, A, B, C, chunk_size=None, D=None, dt_bias=None, initial_states=None,
                     dt_softplus=False, dt_limit=(0.0, float("inf")), **mixer):
    """transformers' ``mamba2_chunk_scan`` (Mamba-2's SSD, Falcon-H1): hidden_states (B, n, H, P), dt (B, n, H),
    A (H,), B and C (B, n, G, N), D (H,); dt + dt_bias, softplus and the limits in torch ops as there;
    ``return_final_states`` and ``z`` by keyword (refused unless False and None). Returns (B, n, H, P)."""
    refused = mixer.pop("problem", None) or _refused(
        initial_states=(initial_states, (None,)), return_final_states=(mixer.pop("return_final_states", False),
                                                                       (False,)), z=(mixer.pop("z", None), (None,)))
    if dt_limit is None:
        refused = refused or "dt_limit=None (time_step_limit=None): mpiring takes Mamba-2's dt limits as (min, max)"
        dt_limit = (0.0, float("inf"))
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = torch.nn.functional.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    y = _Mixer.apply("ssd", ("x", "dt", "A", "B", "C"), mixer, refused,
                     *(t.transpose(1, 2) for t in (hidden_states, dt)), A, *(t.transpose(1, 2) for t in (B, C)))
    y = y.transpose(1, 2).contiguous()
    return y if D is None else y + D[..., None] * hidden_states


def selective_scan(hidden_states, dt, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   return_last_state=False, **mixer):
    """transformers' ``mamba_selective_scan`` (Mamba-1, Jamba): hidden_states and dt (B, channels, n), A
    (channels, N), B and C (B, N, n), D (channels,), z (B, channels, n) the gate. Returns (B, channels, n)."""
    refused = mixer.pop("problem", None) or _refused(return_last_state=(return_last_state, (False,)))
    mixer = {k: v for k, v in mixer.items() if k not in ("use_mambapy", "use_associative_scan")}
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = torch.nn.functional.softplus(dt)
    y = _Mixer.apply("scan", ("x", "dt", "A", "B", "C"), mixer, refused, hidden_states, dt, A, B.transpose(-1, -2),
                     C.transpose(-1, -2))
    if D is not None:
        y = y + hidden_states * D[None, :, None]
    return y if z is None else y * torch.nn.functional.silu(z)
