"""Multi-head latent attention (MLA): K/V travel as the compressed latent and are expanded where they arrive. No MPI.

DeepSeek's MLA keeps, per token, a latent ``c`` of ``r`` values (kv_lora_rank,
512 in DeepSeek-V3) and one rope key ``k_rope`` of ``dr`` values (64) shared
by every head; head h's key and value are ``k_h = [c W_UK[h] | k_rope]`` and
``v_h = c W_UV[h]`` (W_UK[h]: r x d_nope, W_UV[h]: r x dv). A ring that moves
per-head K and V moves ``H (d_nope + dr + dv)`` values per token; the latent
is ``r + dr`` (576 against 128 x 320 = 40,960 for DeepSeek-V3's 128 heads).

``LatentWire`` is a wire (``precision.Wire``'s verbs) whose blocks are the
latent pair ``(c, k_rope)``: it codes them with the call's own wire (half,
int8 or none), and ``own`` and ``arrived`` hand the kernel the block expanded
per head (an ``Expanded`` pair). The backward's per-head dK, dV of a block
are folded back into the latent where they are computed (``Expanded.fold``):
``dc = sum_h dk_nope[h] W_UK[h]^T + dv[h] W_UV[h]^T``, ``dk_rope = sum_h
dk_rope[h]``, so the partials that travel home are latent too; the fold also
adds the block's share of ``dW_UK[h] = c^T dk_nope[h]`` and ``dW_UV[h] = c^T
dv[h]`` to this rank's sums (``Latent.weight_grads``), which the call then sums
over the ranks.

Decoding uses the absorbed form: queries ``[q_rope | q_nope W_UK[h]^T]``
against keys ``[k_rope | c]`` and values ``c``, one K/V head (``absorbed``);
the outputs, in latent space, times ``W_UV[h]`` (``unabsorbed``).
"""

import numpy as np

from .precision import dtype_problem

__all__ = ["Latent", "LatentWire", "Expanded", "latent_problem", "expand", "weight_grad", "absorbed", "latent_keys",
           "unabsorbed", "latent_bytes", "per_head_bytes"]


def latent_problem(q, c, k_rope, w_uk, w_uv):
    """Why this rank's MLA arrays do not fit together, or None (never raises)."""
    for name, a in (("q", q), ("c_kv", c), ("k_rope", k_rope), ("w_uk", w_uk), ("w_uv", w_uv)):
        if not isinstance(a, np.ndarray) or a.ndim < 3 or (dtype_problem(name, a) if name[0] != "w" else
                                                           a.dtype.kind != "f"):
            return (f"{name} must be a float array of 3 or more axes, got {getattr(a, 'dtype', type(a).__name__)} "
                    f"of shape {getattr(a, 'shape', None)}")
    if not q.dtype == c.dtype == k_rope.dtype:
        return f"q, c_kv and k_rope must share one dtype, got {q.dtype}, {c.dtype}, {k_rope.dtype}"
    if w_uk.ndim != 3 or w_uv.ndim != 3 or w_uk.shape[:2] != w_uv.shape[:2]:
        return f"w_uk and w_uv must be (heads, r, d_nope) and (heads, r, dv), got {w_uk.shape} and {w_uv.shape}"
    heads, r, d_nope = w_uk.shape
    if c.shape[-3] != 1 or k_rope.shape[-3] != 1 or c.shape[:-1] != k_rope.shape[:-1]:
        return (f"c_kv and k_rope must be (..., 1, n, r) and (..., 1, n, dr): one latent per token, got "
                f"{c.shape} and {k_rope.shape}")
    if c.shape[-1] != r:
        return f"c_kv has {c.shape[-1]} latent values per token, w_uk and w_uv take r = {r}"
    if q.shape[-3] != heads or q.shape[-1] != d_nope + k_rope.shape[-1]:
        return (f"q must be (..., {heads}, n, {d_nope} + {k_rope.shape[-1]}): the heads of w_uk and [q_nope | "
                f"q_rope], got {q.shape}")
    if q.shape[:-3] != c.shape[:-3]:
        return f"q and c_kv must have the same batch axes, got {q.shape} and {c.shape}"
    return None


def expand(c, k_rope, w_uk, w_uv, dtype=None):
    """Per-head ``(k, v)``: k (..., H, n, d_nope + dr) = [c W_UK[h] | k_rope], v (..., H, n, dv) = c W_UV[h]."""
    dtype = np.result_type(c, w_uk) if dtype is None else dtype
    c = np.asarray(c, dtype)
    nope = np.matmul(c, np.asarray(w_uk, dtype))  # (..., 1, n, r) x (H, r, d_nope): (..., H, n, d_nope)
    k = np.empty(nope.shape[:-1] + (nope.shape[-1] + k_rope.shape[-1],), dtype)
    k[..., :nope.shape[-1]] = nope
    k[..., nope.shape[-1]:] = k_rope
    return k, np.matmul(c, np.asarray(w_uv, dtype))


def _padded(x):
    """x (..., n, d) as the forward kernel's [x | 1]^T (..., d + 1, n)."""
    out = np.empty(x.shape[:-2] + (x.shape[-1] + 1, x.shape[-2]), x.dtype)
    out[..., -1, :] = 1
    out[..., :-1, :] = np.swapaxes(x, -1, -2)
    return out


def weight_grad(c, g):
    """``sum c^T g`` over batch entries and tokens, per head: c (..., n, r), g (..., H, n, d) -> (H, r, d)."""
    return np.einsum("bnr,bhnd->hrd", c.reshape((-1,) + c.shape[-2:]), g.reshape((-1,) + g.shape[-3:]))


class Latent:
    """A call's up-projections and this rank's sums of their gradients (float64, filled by ``Expanded.fold``)."""

    def __init__(self, w_uk, w_uv, dtype):
        self.dtype = np.dtype(dtype)
        self.w_uk, self.w_uv = (np.asarray(w, self.dtype) for w in (w_uk, w_uv))
        self.d_nope = self.w_uk.shape[-1]
        self.weight_grads = [np.zeros(w.shape, np.float64) for w in (self.w_uk, self.w_uv)]

    @property
    def value_dim(self):
        return self.w_uv.shape[-1]

    def expanded(self, block, padded=False):
        """The latent ``block`` (c, k_rope) as the kernel takes K/V (``padded``: [x | 1]^T), able to ``fold``."""
        c, k_rope = (np.asarray(a, self.dtype) for a in block)
        k, v = expand(c, k_rope, self.w_uk, self.w_uv, self.dtype)
        return Expanded((_padded(k), _padded(v)) if padded else (k, v), c, self)


class Expanded(tuple):
    """A block's per-head ``(k, v)``, with the latent ``c`` it came from: ``fold`` turns its gradients latent."""

    def __new__(cls, kv, c, latent):
        made = super().__new__(cls, kv)
        made.c, made.latent = c, latent
        return made

    def fold(self, grads):
        """``block.block_grads``' per-head ``[(k0, k1, dk, dv)]`` as ``[(k0, k1, dc, dk_rope)]``; adds the keys'
        share of dW_UK and dW_UV to the latent's ``weight_grads``."""
        lat, out = self.latent, []
        for k0, k1, dk, dv in grads:
            nope, c = dk[..., :lat.d_nope], self.c[..., 0, k0:k1, :]
            dc = (np.matmul(nope, np.swapaxes(lat.w_uk, -1, -2)) + np.matmul(dv, np.swapaxes(lat.w_uv, -1, -2)))
            lat.weight_grads[0] += weight_grad(c, nope)
            lat.weight_grads[1] += weight_grad(c, dv)
            out.append((k0, k1, dc.sum(axis=-3, keepdims=True), dk[..., lat.d_nope:].sum(axis=-3, keepdims=True)))
        return out


class LatentWire:
    """The latent pair on the wire: coded as ``wire`` codes (half, int8, or as it is), expanded per head where it is
    used; this rank's own block exactly (``precision.Wire``'s verbs, so every K/V movement takes it)."""

    coded = True  # a block never travels in the kernel's form: it is expanded first

    def __init__(self, wire, latent):
        self.wire, self.latent = wire, latent
        self.name = f"latent ({wire.name})"
        self.value_dim = latent.value_dim  # the outputs' head dim (``block.accumulators``)

    def encode(self, a, out=None):
        if out is None:
            return self.wire.encode(a)
        out[...] = self.wire.encode(a)
        return out

    def template(self, a):
        return self.wire.template(a) if self.wire.coded else np.empty(a.shape, a.dtype)

    def own(self, block, padded=False):
        return self.latent.expanded(block, padded)

    def arrived(self, block, padded=False):
        return self.latent.expanded(self.wire.arrived(block), padded)


# ---------------------------------------------------------------- decoding: the absorbed form


def absorbed(q, w_uk):
    """Queries (..., H, T, d_nope + dr) in the absorbed form (..., H, T, dr + r): ``[q_rope | q_nope W_UK[h]^T]``,
    against the keys ``latent_keys`` (their scores are the per-head ones: q_nope . c W_UK[h] = q_nope W_UK[h]^T . c)."""
    d_nope = w_uk.shape[-1]
    dtype = np.result_type(q, w_uk)
    nope = np.matmul(np.asarray(q[..., :d_nope], dtype), np.swapaxes(np.asarray(w_uk, dtype), -1, -2))
    return np.concatenate([np.asarray(q[..., d_nope:], dtype), nope], axis=-1)


def latent_keys(c, k_rope):
    """One K/V head per token for decoding: keys ``[k_rope | c]`` (..., 1, n, dr + r); the values are ``c``, their
    last r values (a cache stores them once: ``KVCache(..., shared_values=True)``)."""
    return np.concatenate([k_rope, c], axis=-1)


def unabsorbed(out, w_uv):
    """Outputs in latent space (..., H, T, r) to the heads' values (..., H, T, dv): ``out_h W_UV[h]``."""
    return np.matmul(out, np.asarray(w_uv, np.result_type(out, w_uv)))


def latent_bytes(r, dr, itemsize):
    """Bytes of one token's K/V as the latent moves them: c and k_rope."""
    return (r + dr) * itemsize


def per_head_bytes(heads, d_nope, dr, dv, itemsize):
    """Bytes of one token's K/V as per-head K (d_nope + dr) and V (dv) move them."""
    return heads * (d_nope + dr + dv) * itemsize
