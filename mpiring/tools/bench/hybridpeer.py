"""The sequence mixers' peer, timed in a child process: transformers' own CPU code on the whole sequence.

    python mpiring/tools/bench/hybridpeer.py < job.json        # what ``mixer_times`` starts

The child runs this file as a script (it imports no part of the package, so it
never starts MPI) with ``threads`` torch threads while the ranks idle. The
functions are those transformers 5.23 falls back to without its CUDA kernels:
LFM2's ``causal_conv1d_fn``, Qwen3-Next's ``torch_chunk_gated_delta_rule``,
Falcon-H1's ``mamba2_chunk_scan`` and Jamba's ``mamba_selective_scan``.
"""

import json
import statistics
import sys
import time

__all__ = ["mixer_times", "SHAPES"]

# the rows' shapes (float32, batch 1): hidden sizes of small hybrids
SHAPES = {
    "conv": dict(C=2048, width=4),  # LFM2's short convolution over its in_proj's B*x
    "gdn": dict(Hk=4, Hv=8, dk=64, dv=64),  # Qwen3-Next's heads, fewer
    "ssd": dict(H=16, P=64, G=1, N=64, chunk=256),  # Falcon-H1's Mamba-2 mixer, smaller
    "mamba": dict(D=512, N=16),  # Jamba's Mamba-1 mixer, smaller (transformers loops over the tokens)
}


def mixer_times(rows, threads, repeats=3, budget=30.0, timeout=3600):
    """Per row ``(mixer, S)``: ``(forward s, forward+backward s)`` medians of transformers' function (None where it
    failed), from a child process with ``threads`` threads."""
    from .probes import child_json  # here, not at the top: this file also runs as a script

    job = {"rows": rows, "threads": threads, "repeats": repeats, "budget": budget}
    found = child_json(__file__, job, threads, timeout)
    return [tuple(r) if r else None for r in found] if found else [None] * len(rows)


def _case(mixer, S, torch):
    """transformers' function and its float32 inputs (requiring grad) for one row."""
    g = torch.Generator().manual_seed(0)
    shape = SHAPES[mixer]

    def t(*size, scale=1.0, low=False):
        x = torch.rand(*size, generator=g) if low else torch.randn(*size, generator=g)
        return (x * scale).requires_grad_()

    if mixer == "conv":
        from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn
        return lambda x, w: causal_conv1d_fn(x, w, None), [t(1, shape["C"], S), t(shape["C"], shape["width"])]
    if mixer == "gdn":
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        Hk, Hv, dk, dv = shape["Hk"], shape["Hv"], shape["dk"], shape["dv"]
        args = [t(1, S, Hk, dk), t(1, S, Hk, dk), t(1, S, Hv, dv), t(1, S, Hv, scale=-0.1, low=True),
                t(1, S, Hv, low=True)]
        return lambda *a: torch_chunk_gated_delta_rule(*a, chunk_size=64, use_qk_l2norm_in_kernel=True)[0], args
    if mixer == "ssd":
        from transformers.models.falcon_h1.modeling_falcon_h1 import mamba2_chunk_scan
        H, P, G, N = shape["H"], shape["P"], shape["G"], shape["N"]
        args = [t(1, S, H, P), t(1, S, H), t(H, scale=-1.0, low=True), t(1, S, G, N), t(1, S, G, N), t(H), t(H)]
        return (lambda x, dt, A, B, C, D, bias: mamba2_chunk_scan(x, dt, A, B, C, shape["chunk"], D=D, dt_bias=bias,
                                                                  dt_softplus=True)), args
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan
    D, N = shape["D"], shape["N"]
    args = [t(1, D, S), t(1, D, S), t(D, N, scale=-1.0, low=True), t(1, N, S), t(1, N, S), t(D), t(1, D, S), t(D)]
    return (lambda x, dt, A, B, C, Dd, z, bias: mamba_selective_scan(x, dt, A, B, C, D=Dd, z=z, delta_bias=bias,
                                                                     delta_softplus=True)), args


def _median_seconds(run, repeats, budget):
    run()  # warm-up
    samples, spent = [], 0.0
    while len(samples) < repeats and spent < budget:
        start = time.perf_counter()
        run()
        samples.append(time.perf_counter() - start)
        spent += samples[-1]
    return statistics.median(samples)


def _worker():
    import torch

    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    out = []
    for mixer, S in job["rows"]:
        try:
            out.append(_times(*_case(mixer, S, torch), torch, job["repeats"], job["budget"]))
        except Exception:  # noqa: BLE001 (the row says it failed)
            out.append(None)
    print(json.dumps(out))


def _times(fn, args, torch, repeats, budget):
    """[forward s (no grad), forward+backward s] of ``fn(*args)``."""
    def both():
        y = fn(*args)
        y.backward(torch.ones_like(y))

    with torch.no_grad():
        forward = _median_seconds(lambda: fn(*args), repeats, budget)
    return [forward, _median_seconds(both, repeats, budget)]


if __name__ == "__main__":
    _worker()
