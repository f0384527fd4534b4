"""Time a context-parallel training step of a Hugging Face Llama against the same step in one process.

    mpiexec -n 2 python examples/hf_step_time.py --seq-len 2048 8192 --dtype float32

Every rank runs forward, backward and the gradient all-reduce on its shard under
mpiring.hf (one torch thread each); then rank 0 runs the same step on the whole
sequence in one process with transformers' SDPA, with as many torch threads as there
are ranks (the same cores; the other ranks wait asleep), then with one. Each figure
is the fastest of --repeat steps, after one warm-up step. Prints the machine line (CPU, vector extensions) first.
"""

import argparse
import copy
import os
import time

import torch
from mpi4py import MPI
from transformers import LlamaConfig, LlamaForCausalLM

import mpiring.hf
from mpiring.core.tuning.machine import cpu_model

parser = argparse.ArgumentParser()
parser.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192])
parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
parser.add_argument("--repeat", type=int, default=3)
args = parser.parse_args()
comm, dtype = MPI.COMM_WORLD, getattr(torch, args.dtype)
config = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)


def fastest(cp, attn, ids, comm):
    """The fastest of args.repeat training steps (after a warm-up), the slowest rank's."""
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=dtype)
    times = []
    for _ in range(args.repeat + 1):
        comm.Barrier()
        start = time.perf_counter()
        batch = cp.shard(ids)
        inputs = batch.inputs if attn == cp.name else {k: v for k, v in batch.inputs.items() if k != "mpiring"}
        cp.loss(model(**inputs).logits, batch).backward()
        cp.all_reduce_gradients(model)
        model.zero_grad()
        times.append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return min(times[1:])


if comm.rank == 0:
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores; vector extensions as torch uses them: "
          f"{torch.backends.cpu.get_cpu_capability()}); load average {os.getloadavg()[0]:.1f}", flush=True)
with mpiring.hf.ContextParallel(comm, layout="zigzag") as cp:
    for S in args.seq_len:
        ids = torch.randint(0, config.vocab_size, (1, S), generator=torch.Generator().manual_seed(S))
        torch.set_num_threads(1)
        ring = fastest(cp, "mpiring", ids, comm)
        if comm.rank == 0:
            alone = {}
            for threads in sorted({comm.size, 1}, reverse=True):
                torch.set_num_threads(threads)
                with mpiring.hf.ContextParallel(MPI.COMM_SELF, layout="contiguous") as one:
                    alone[threads] = fastest(one, "sdpa", ids, MPI.COMM_SELF)
            print(f"S={S} {args.dtype} P={comm.size}: context-parallel step {ring:.3f} s; one process "
                  + ", ".join(f"{t} thread{'s' * (t > 1)} {a:.3f} s ({ring / a:.2f}x)" for t, a in alone.items()),
                  flush=True)
        done = comm.Ibarrier()  # the other ranks wait asleep, leaving rank 0's threads their cores
        while not done.Test():
            time.sleep(0.01)
