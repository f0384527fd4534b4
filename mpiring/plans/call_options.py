"""What a call on a ``Ring`` may pass beside its arrays: the Ring's own options, checked equal; nothing else.

A model passes its attention options at every call (transformers passes
``scaling``); a ``Ring`` fixed them when it was built. A call may repeat them:
equal values are accepted, a differing one is refused (the Ring would compute
something else than the model asked for), and a name that is no option of
mpiring's says what is supported and where it goes. No MPI: the messages
reach every rank through the call's agreement.
"""

import numpy as np

from ..core.kernels import default_scale
from .axes import seq_index
from .checks import scale_problem
from .spec import FIELDS, SCORE_FIELDS, Spec
from .visibility import check_window

__all__ = ["CALL_OPTIONS", "RUN", "RING_OPTIONS", "options_problem", "foreign_problem", "split"]

# a spec's fields that say which tokens the ranks hold: fixed when a Ring is built, not repeated per call
FIXED = ("seq_len", "positions", "kv_positions", "node_size")
# how a call runs, beside what it computes (the spec): given to a Ring or to a function, never to a Spec
RUN = ("timeout", "seq_axis", "threads", "check_finite", "expected_size")
# the Ring's options a call may repeat (the same value), as ``Ring.options`` holds them
CALL_OPTIONS = tuple(name for name in FIELDS if name not in FIXED) + ("timeout", "seq_axis", "check_finite")
SCORES = ("mask",) + SCORE_FIELDS  # compared as the spec does (functions and pieces by what they read)
# options of a Ring that are fixed when it is built and not repeated per call
BUILT = FIXED + ("threads", "expected_size", "comm")
RING_OPTIONS = tuple(FIELDS) + RUN + ("spec",)  # the keywords a Ring takes (and ring_attention, with record)

MASKS = ("causal=True, window=(left, right), cu_seqlens= (packed documents), causal_block= (frames), and mask= "
         "(mpiring.masks: prefix, padding, function(fn), combined with & and |)")
# names other libraries use, and what mpiring supports instead
FOREIGN = {
    "attn_mask": f"a dense mask tensor is not taken; mpiring's masks are rules of positions: {MASKS}",
    "is_causal": "mpiring's name is causal (causal=True)",
    "dropout_p": "mpiring's name is dropout (with seed=, the key of which weights drop)",
    "scaling": "mpiring's name is scale",
    "softmax_scale": "mpiring's name is scale",
    "sliding_window": "mpiring's sliding window is window=(left, right): keys i - left .. i + right of query i",
    "window_size": "mpiring's name is window, (left, right) as in flash-attn",
    "enable_gqa": "grouped-query attention needs no option: give k and v fewer heads than q",
    "cu_seqlens_q": "mpiring's name is cu_seqlens (the same for queries and keys)",
    "cu_seqlens_k": "mpiring's name is cu_seqlens (the same for queries and keys)",
}
FOREIGN["attention_mask"] = FOREIGN["attn_mask"]


def foreign_problem(name, where):
    """Why ``name`` is no option of mpiring's; ``where`` says where its options go."""
    advice = FOREIGN.get(name, f"the options are {', '.join(CALL_OPTIONS + BUILT)}")
    return f"{name} is not an option of mpiring ({advice}); {where}"


def _same(name, given, held, q):
    """Whether a call's ``given`` value of option ``name`` is the Ring's ``held`` one, for arrays like ``q``."""
    if name == "scale":  # effective scales, the default resolved for q's head dim: exactly equal
        dim = q.shape[-1]
        if held is None and given is not None:  # the default spelled 1/sqrt(dim) or dim ** -0.5 (transformers'):
            return float(given) in (default_scale(dim), dim ** -0.5)  # the two differ in the last bit for 8, 32, 128
        return (default_scale(dim) if given is None else float(given)) == (
            default_scale(dim) if held is None else float(held))
    if name == "window":
        return check_window(given) == tuple(held)
    if name == "cu_seqlens":
        return (given is None) == (held is None) and (given is None or np.array_equal(np.asarray(given), held))
    if name == "seq_axis":
        return isinstance(given, (str, int, np.integer)) and seq_index(given, q.ndim) == seq_index(held, q.ndim)
    if name in SCORES:  # by what they are, as the spec compares them (functions by what they read)
        if given is held:
            return True
        try:
            return Spec.of(**{name: given}).field_key(name) == Spec.of(**{name: held}).field_key(name)
        except (TypeError, ValueError):
            return False
    if name in ("causal", "check_finite"):
        return isinstance(given, (bool, np.bool_)) and bool(given) == held
    return type(given) is type(held) and given == held if isinstance(given, str) else given == held


def options_problem(given, held, q):
    """Why a call's ``given`` options do not match the Ring's ``held`` ones (``Ring.options``), or None.

    ``q``: this call's queries (sequence axis moved): the default scale is 1/sqrt of its head dim.
    """
    for name, value in given.items():
        if name not in CALL_OPTIONS:
            if name in BUILT:
                return f"{name} is fixed when the Ring is built; a call cannot change it: give it to mpiring.Ring"
            return foreign_problem(name, "the options of a Ring go to mpiring.Ring(...)")
        problem = scale_problem(value) if name == "scale" else None
        if problem is None and not _same(name, value, held[name], q):
            shown = held[name]
            if name == "scale":  # head_dim ** -0.5 and 1/sqrt(head_dim) may differ in the last bit
                dim = q.shape[-1]
                shown = f"{float(default_scale(dim))!r} (its default 1/sqrt({dim}))" if shown is None else shown
                value = float(default_scale(dim) if value is None else value)
            elif isinstance(shown, np.ndarray):
                shown = shown.tolist()
            problem = (f"{name}={value!r} given to this call differs from the Ring's {shown}: the Ring would compute "
                       f"something else; build the Ring with {name}={value!r} (a Ring's options are fixed)")
        if problem:
            return problem
    return None


def split(options):
    """An entry point's keyword ``options`` as ``(spec keywords, run keywords)``: the names in ``RUN`` (how the
    call runs) apart from the rest, which go to ``Spec.of`` (an unknown name is refused there)."""
    run = {name: options[name] for name in RUN if name in options}
    return {name: value for name, value in options.items() if name not in RUN}, run
