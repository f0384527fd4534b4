"""torch's ``scaled_dot_product_attention`` on the whole sequence, timed in a child process.

    python mpiring/tools/torchref.py --torch-worker < job.json    # what ``torch_times`` starts

The child runs this file as a script: it imports no part of the package, so it
never starts MPI, and torch's threads run while the ranks idle.
"""

import functools
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

__all__ = ["torch_available", "torch_times"]


def torch_available():
    """True if torch can be imported."""
    return importlib.util.find_spec("torch") is not None


def torch_times(configs, threads, repeats=3, budget=30.0, timeout=3600):
    """Median seconds of torch SDPA per benchmark row in ``configs`` (None where it failed), from a child process."""
    from .probes import child_env  # here, not at the top: this file also runs as a script

    job = {"configs": [[c.S, c.D, c.H, c.B, c.causal, c.backward, c.dtype] for c in configs],
           "threads": threads, "repeats": repeats, "budget": budget}
    env = child_env(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    try:
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-worker"], input=json.dumps(job),
                              env=env, capture_output=True, text=True, timeout=timeout)
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return [None] * len(configs)


def _sdpa_seconds(F, torch, q, k, v, dout, causal):
    """Seconds of one SDPA pass: forward, and backward too when ``dout`` is given."""
    start = time.perf_counter()
    if dout is not None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(dout)
        q.grad = k.grad = v.grad = None
    else:
        with torch.no_grad():
            F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return time.perf_counter() - start


def _torch_worker():
    """Child process: read a job from stdin, print the median SDPA seconds of each config."""
    import torch
    import torch.nn.functional as F

    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    results = []
    for S, D, H, B, causal, backward, dtype in job["configs"]:
        try:
            gen = torch.Generator().manual_seed(0)
            dt = getattr(torch, dtype)
            q, k, v = (torch.randn(B, H, S, D, generator=gen, dtype=dt, requires_grad=backward) for _ in range(3))
            dout = torch.randn(B, H, S, D, generator=gen, dtype=dt) if backward else None
            once = functools.partial(_sdpa_seconds, F, torch, q, k, v, dout, causal)
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
