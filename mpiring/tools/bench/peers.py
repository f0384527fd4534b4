"""The peers, timed in child processes while the ranks idle: torch SDPA on the whole sequence, and PyTorch's own
context parallel over gloo (``torch.distributed.tensor.experimental.context_parallel`` shards the inputs, load
balanced for causal rows; its ring templates run the passes on the CPU flash ops, ``_ring_pass``).

The children run this file as a script (``--torch-worker``, ``--cp-worker R P PORT JOB``): it imports no part
of the package, so they never start MPI. Where torch's context parallel raises, the error is the result.
"""

import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["torch_available", "torch_times", "context_parallel_times"]


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


def _sdpa_seconds(F, torch, q, k, v, dout, causal):
    """Seconds of one SDPA pass: forward, and backward too when ``dout`` is given."""
    start = time.perf_counter()
    if dout is not None:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(dout)
        q.grad = k.grad = v.grad = None
    else:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return time.perf_counter() - start


def _torch_worker():
    """Child process: read a job from stdin, print the median SDPA seconds of each row (within the budget)."""
    import torch
    import torch.nn.functional as F

    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    results = []
    for row in job["configs"]:
        try:
            once = functools.partial(_sdpa_seconds, F, torch, *_inputs(torch, row), row[4])
            first = once()
            samples = [first] if first * (job["repeats"] + 1) > job["budget"] else []
            while len(samples) < job["repeats"] and (not samples or sum(samples) + samples[-1] <= job["budget"]):
                samples.append(once())
            results.append(statistics.median(samples))
        except Exception:  # noqa: BLE001 - report a missing figure, not a crash
            results.append(None)
    print(json.dumps(results))


if __name__ == "__main__" and sys.argv[1:] == ["--torch-worker"]:
    _torch_worker()
elif __name__ == "__main__" and sys.argv[1:2] == ["--cp-worker"]:
    _cp_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
