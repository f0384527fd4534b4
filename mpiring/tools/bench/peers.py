"""The peers, timed in child processes while the ranks idle: torch SDPA on the whole sequence, PyTorch's own
context parallel over gloo (``torch.distributed.tensor.experimental.context_parallel`` shards the inputs, load
balanced for causal rows; its ring templates run the passes on the CPU flash ops, ``_ring_pass``), and
transformers' CPU code of the sequence mixers.

The children run this file as a script (``--torch-worker``, ``--mixer-worker``, ``--cp-worker R P PORT JOB``):
it imports no part of the package, so they never start MPI. Where torch's context parallel raises, the error
is the result. The mixers' functions are those transformers 5.23 falls back to without its CUDA kernels:
LFM2's ``causal_conv1d_fn``, Qwen3-Next's ``torch_chunk_gated_delta_rule``, Falcon-H1's ``mamba2_chunk_scan``
and Jamba's ``mamba_selective_scan``.
"""

import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["torch_available", "torch_times", "context_parallel_times", "mixer_times", "mixer_inputs", "median_seconds",
           "SHAPES"]

# the mixer rows' shapes (float32, batch 1): hidden sizes of small hybrids
SHAPES = {
    "conv": dict(C=2048, width=4),  # LFM2's short convolution over its in_proj's B*x
    "gdn": dict(Hk=4, Hv=8, dk=64, dv=64),  # Qwen3-Next's heads, fewer
    "ssd": dict(H=16, P=64, G=1, N=64, chunk=256),  # Falcon-H1's Mamba-2 mixer, smaller
    "mamba": dict(D=512, N=16),  # Jamba's Mamba-1 mixer, smaller (transformers loops over the tokens)
}


def torch_available():
    """True if torch can be imported."""
    return importlib.util.find_spec("torch") is not None


def _job(configs, **extra):
    return {"configs": [[c.S, c.D, c.H, c.B, c.causal, c.backward, c.dtype] for c in configs], **extra}


def torch_times(configs, threads, repeats=3, budget=30.0, timeout=3600):
    """Median seconds of torch SDPA per benchmark row in ``configs`` (None where it failed), from a child process."""
    from .probes import child_json

    job = _job(configs, threads=threads, repeats=repeats, budget=budget)
    return child_json(__file__, job, threads, timeout, "--torch-worker") or [None] * len(configs)


def context_parallel_times(configs, ranks, timeout=600):
    """Per row: (median seconds of the slowest of ``ranks`` processes, None) or (None, the error it raised)."""
    import socket

    from .probes import child_env

    with socket.socket() as sock:  # a free port for gloo's rendezvous
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = child_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    procs = []
    try:  # the job on the command line: every process has it at once (they meet in gloo's rendezvous)
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--cp-worker", str(r), str(ranks),
                                   str(port), json.dumps(_job(configs))], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, env=env, text=True) for r in range(ranks)]
        per_rank = [json.loads(p.communicate(timeout=timeout)[0].strip().splitlines()[-1]) for p in procs]
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as e:
        for p in procs:
            p.kill()
        return [(None, f"the {ranks} processes failed: {type(e).__name__}: {e}")] * len(configs)
    results = []
    for row in zip(*per_rank):
        errors = [err for _, err in row if err]
        results.append((None, errors[0]) if errors else (max(t for t, _ in row), None))
    return results


def mixer_times(rows, threads, repeats=3, budget=30.0, timeout=3600):
    """Per row ``(mixer, S)``: ``(forward s, forward+backward s)`` medians of transformers' function (None where it
    failed), from a child process with ``threads`` threads."""
    from .probes import child_json

    job = {"rows": rows, "threads": threads, "repeats": repeats, "budget": budget}
    found = child_json(__file__, job, threads, timeout, "--mixer-worker")
    return [tuple(r) if r else None for r in found] if found else [None] * len(rows)


def _inputs(torch, row):
    """q, k, v (and dout for a backward row) of a job row, from a seeded generator."""
    S, D, H, B, causal, backward, dtype = row
    gen, dt = torch.Generator().manual_seed(0), getattr(torch, dtype)
    arrays = [torch.randn(B, H, S, D, generator=gen, dtype=dt, requires_grad=backward) for _ in range(3)]
    return arrays + [torch.randn(B, H, S, D, generator=gen, dtype=dt) if backward else None]


def _error(e):
    return f"{type(e).__name__}: {e}".splitlines()[0]


def _cp_worker(rank, ranks, port, job):
    """Child process ``rank`` of ``ranks``: context parallel SDPA on each job row; prints [(seconds, error), ...]."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    rows = json.loads(job)["configs"]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=ranks)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.experimental import context_parallel
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp

        mesh = init_device_mesh("cpu", (ranks,))
    except Exception as e:  # noqa: BLE001 - the error is the result
        print(json.dumps([(None, _error(e))] * len(rows)))
        return
    results = []
    for row in rows:
        causal, backward = row[4], row[5]
        try:
            q, k, v, dout = (None if x is None else x.detach() for x in _inputs(torch, row))
            buffers = [q, k, v] + ([dout] if backward else [])
            samples = []
            cp._cp_options.enable_load_balance = causal  # its ring refuses load balancing without a causal mask
            for _ in range(2):
                dist.barrier()
                start = time.perf_counter()
                with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[2] * len(buffers)):
                    _ring_pass(torch, cp, mesh.get_group(), q, k, v, dout, causal)
                samples.append(time.perf_counter() - start)
            results.append((min(samples), None))
        except Exception as e:  # noqa: BLE001 - the error is the result, printed in the table
            results.append((None, _error(e)))
    dist.destroy_process_group()
    print(json.dumps(results))


def _ring_pass(torch, cp, group, q, k, v, dout, causal):
    """One pass of torch's context-parallel ring on this process's shards (the buffers ``context_parallel``
    sharded, load-balanced when causal): forward, and backward too when ``dout`` is given.

    Its SDPA dispatcher has ring handlers for the CUDA ops only (the CPU flash op, which SDPA takes here, raised
    "no sharding strategy" for the backward and for causal rows), so its ring templates are called with the
    CPU flash ops, as its handlers call them with the CUDA ones.
    """
    ops = torch.ops.aten
    with torch.no_grad():
        out, lse, *_ = cp._templated_ring_attention(group, 2, ops._scaled_dot_product_flash_attention_for_cpu,
                                                    q, k, v, is_causal=causal, dropout_p=0.0)
        if dout is not None:
            cp._templated_ring_attention_backward(group, 2, ops._scaled_dot_product_flash_attention_for_cpu_backward
                                                  .default, dout, "grad_out", q, k, v, out, lse, causal,
                                                  dropout_p=0.0)


def _sdpa(F, torch, q, k, v, dout, causal):
    """One SDPA pass: forward, and backward too when ``dout`` is given."""
    if dout is not None:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
        q.grad = k.grad = v.grad = None
    else:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def median_seconds(run, repeats, budget, clock=None):
    """The median seconds of ``run()`` over ``repeats`` runs after one to warm up (which counts, cold, if it took
    the whole budget), fewer when the budget runs out. ``clock(run)``: one run's seconds (default: its wall time)."""
    def wall(fn):
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    once = functools.partial(clock or wall, run)
    first = once()
    samples = [first] if first > budget else []
    while len(samples) < repeats and (not samples or sum(samples) + samples[-1] <= budget):
        samples.append(once())
    return statistics.median(samples)


def _worker(rows, each):
    """Child process: read a job from stdin, print ``each(torch, row, job)`` of every row (None where it raised)."""
    import torch

    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    results = []
    for row in job[rows]:
        try:
            results.append(each(torch, row, job))
        except Exception:  # noqa: BLE001 - report a missing figure, not a crash
            results.append(None)
    print(json.dumps(results))


def _sdpa_median(torch, row, job):
    import torch.nn.functional as F

    return median_seconds(functools.partial(_sdpa, F, torch, *_inputs(torch, row), row[4]), job["repeats"],
                          job["budget"])


def mixer_inputs(mixer, n, torch, seed):
    """The float32 inputs (requiring grad) of a mixer row over ``n`` tokens, drawn with ``seed``, in transformers'
    order: conv (x, w); gdn (q, k, v, g, beta); ssd (x, dt, A, B, C, D, dt_bias); mamba (x, dt, A, B, C, D, z,
    delta_bias)."""
    g, s = torch.Generator().manual_seed(seed), SHAPES[mixer]

    def t(*size, scale=1.0, low=False):
        x = torch.rand(*size, generator=g) if low else torch.randn(*size, generator=g)
        return (x * scale).requires_grad_()

    if mixer == "conv":
        return [t(1, s["C"], n), t(s["C"], s["width"])]
    if mixer == "gdn":
        Hk, Hv, dk, dv = s["Hk"], s["Hv"], s["dk"], s["dv"]
        return [t(1, n, Hk, dk), t(1, n, Hk, dk), t(1, n, Hv, dv), t(1, n, Hv, scale=-0.1, low=True),
                t(1, n, Hv, low=True)]
    if mixer == "ssd":
        H, P, G, N = s["H"], s["P"], s["G"], s["N"]
        return [t(1, n, H, P), t(1, n, H), t(H, scale=-1.0, low=True), t(1, n, G, N), t(1, n, G, N), t(H), t(H)]
    D, N = s["D"], s["N"]
    return [t(1, D, n), t(1, D, n), t(D, N, scale=-1.0, low=True), t(1, N, n), t(1, N, n), t(D), t(1, D, n), t(D)]


def _transformers_mixer(mixer):
    """transformers' CPU function of ``mixer``, taking ``mixer_inputs``' arrays."""
    if mixer == "conv":
        from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn
        return lambda x, w: causal_conv1d_fn(x, w, None)
    if mixer == "gdn":
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule
        return lambda *a: torch_chunk_gated_delta_rule(*a, chunk_size=64, use_qk_l2norm_in_kernel=True)[0]
    if mixer == "ssd":
        from transformers.models.falcon_h1.modeling_falcon_h1 import mamba2_chunk_scan
        return lambda x, dt, A, B, C, D, bias: mamba2_chunk_scan(x, dt, A, B, C, SHAPES["ssd"]["chunk"], D=D,
                                                                 dt_bias=bias, dt_softplus=True)
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan
    return lambda x, dt, A, B, C, D, z, bias: mamba_selective_scan(x, dt, A, B, C, D=D, z=z, delta_bias=bias,
                                                                   delta_softplus=True)


def _mixer_medians(torch, row, job):
    """[forward s (no grad), forward+backward s] of transformers' function of ``row`` (mixer, S)."""
    mixer, S = row
    fn, args = _transformers_mixer(mixer), mixer_inputs(mixer, S, torch, 0)

    def both():
        y = fn(*args)
        y.backward(torch.ones_like(y))

    with torch.no_grad():
        forward = median_seconds(lambda: fn(*args), job["repeats"], job["budget"])
    return [forward, median_seconds(both, job["repeats"], job["budget"])]


if __name__ == "__main__" and sys.argv[1:] == ["--torch-worker"]:
    _worker("configs", _sdpa_median)
elif __name__ == "__main__" and sys.argv[1:] == ["--mixer-worker"]:
    _worker("rows", _mixer_medians)
elif __name__ == "__main__" and sys.argv[1:2] == ["--cp-worker"]:
    _cp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
