"""Train a Hugging Face Llama under context parallelism: mpiring is its attention, each rank holds a shard.

    mpiexec -n 4 python examples/train_hf.py [--steps 3] [--seq-len 48] [--dtype float64]

Every rank trains the same tiny random-init model on its shard of one packed batch (three
documents); rank 0 then trains a copy on the whole batch in one process (transformers' SDPA)
and prints the largest differences of the losses and of the parameters.
"""

import argparse
import copy

import torch
from mpi4py import MPI
from transformers import LlamaConfig, LlamaForCausalLM

import mpiring.hf

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("--seq-len", type=int, default=48)
parser.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
args = parser.parse_args()
comm, dtype, S = MPI.COMM_WORLD, getattr(torch, args.dtype), args.seq_len
torch.set_num_threads(1)

config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
ids = torch.randint(0, 128, (2, S), generator=torch.Generator().manual_seed(0))  # the same batch on every rank
documents = [0, S // 3, S // 2, S]  # packed documents: attention never crosses a boundary


def train(cp, attn):
    """args.steps SGD steps under ``cp``: the batch's losses and the trained model."""
    torch.manual_seed(0)  # the same initial parameters on every rank
    model = LlamaForCausalLM._from_config(copy.deepcopy(config), attn_implementation=attn, dtype=dtype)
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.5), []
    for _ in range(args.steps):
        batch = cp.shard(ids, documents=documents)  # this rank's tokens, per-document positions, shifted labels
        inputs = batch.inputs if attn == cp.name else {k: v for k, v in batch.inputs.items() if k != "mpiring"}
        loss = cp.loss(model(**inputs).logits, batch)  # this rank's share of the batch's mean
        loss.backward()
        cp.all_reduce_gradients(model)  # the sum over ranks: the whole batch's gradient
        opt.step()
        opt.zero_grad()
        losses.append(cp.reduce(loss))
    return losses, model


with mpiring.hf.ContextParallel(comm, layout="zigzag") as cp:
    losses, model = train(cp, "mpiring")
if comm.rank == 0:
    with mpiring.hf.ContextParallel(MPI.COMM_SELF, layout="contiguous") as one:
        want, reference = train(one, "sdpa")
    loss_error = max(abs(a - b) for a, b in zip(losses, want))
    param_error = max(float((p - r).detach().abs().max()) for p, r in zip(model.parameters(), reference.parameters()))
    print(f"P={comm.size} S={S} {args.dtype}: losses {', '.join(f'{x:.6f}' for x in losses)}; "
          f"largest differences from one process: loss {loss_error:.1e}, parameters {param_error:.1e}")
