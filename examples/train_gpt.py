"""Train a tiny causal transformer with context parallelism, and check it against single-process training.

    mpiexec -n 4 python examples/train_gpt.py                       # zigzag, ring, 5 AdamW steps, float64
    mpiexec -n 3 python examples/train_gpt.py --layout all --mode all --documents

Every rank holds its shard of every sequence (``ring.shard``), with the
global positions of its tokens (``ring.positions``) for the position
embedding, and labels shifted on the whole sequence before sharding (with
zigzag or striped, a token's next token lives on another rank). Attention is
``mpiring.torch.ring_attention`` over a ``mpiring.Ring`` made once, on
flash-attn-style (B, S, H, D) tensors; everything else in the model is
per-token and needs no communication. The loss is summed over every rank's
tokens, and the gradients of the (replicated) parameters are all-reduced
before each AdamW step. The same model trained in one process with PyTorch's
own attention on whole sequences is the reference: losses and parameters must
agree to 1e-10 and 1e-9 (float64). With ``--documents`` the sequences are
packed documents (``cu_seqlens``) whose position ids restart at each one.
"""

import argparse
import itertools
import sys

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI

import mpiring
import mpiring.torch

VOCAB, DIM, HEADS, KV_HEADS, LAYERS, SEQ, BATCH = 37, 32, 4, 2, 2, 40, 2


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
        self.q = torch.nn.Linear(DIM, DIM)
        self.kv = torch.nn.Linear(DIM, 2 * DIM * KV_HEADS // HEADS)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(), torch.nn.Linear(4 * DIM, DIM))

    def forward(self, x, attention):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, HEADS, DIM // HEADS)  # (B, S, H, D): the ring takes it as it is
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, DIM // HEADS).unbind(2)
        x = x + self.proj(attention(q, k, v).reshape(b, s, DIM))
        return x + self.mlp(self.norm2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens, self.positions = torch.nn.Embedding(VOCAB, DIM), torch.nn.Embedding(SEQ, DIM)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(DIM, VOCAB)

    def forward(self, tokens, positions, attention):
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x, attention)
        return self.head(x)


def sdpa(mask):
    """The reference attention: PyTorch's own, on whole (B, S, H, D) sequences, K/V heads repeated for GQA."""

    def attention(q, k, v):
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask)
        return out.transpose(1, 2)

    return attention


def data(documents):
    """Seeded token batches, labels shifted on the whole sequence, and the documents' boundaries."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    labels = torch.full_like(tokens, -100)  # -100: no next token to predict
    labels[:, :-1] = tokens[:, 1:]
    cu = np.array([0, 7, 18, 19, 33, SEQ]) if documents else None
    if cu is not None:
        labels[:, cu[1:] - 1] = -100  # a document's last token does not predict the next document's first
    return tokens, labels, cu


def position_ids(positions, cu):
    """Positions of tokens (global, or counted from their document's start when packed)."""
    positions = np.asarray(positions)
    if cu is None:
        return positions
    return positions - cu[np.searchsorted(cu, positions, side="right") - 1]


def reference_mask(cu):
    pos = np.arange(SEQ)
    allowed = pos[None, :] <= pos[:, None]
    if cu is not None:
        doc = np.searchsorted(cu, pos, side="right")
        allowed &= doc[None, :] == doc[:, None]
    return torch.from_numpy(allowed)


def train(comm, layout, mode, documents, steps):
    """Train both models side by side; returns the largest relative loss and absolute parameter differences."""
    tokens, labels, cu = data(documents)
    valid = int((labels != -100).sum())
    torch.manual_seed(0)
    model = TinyGPT()
    reference = TinyGPT()
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ring = mpiring.Ring(comm, SEQ, causal=True, layout=layout, mode=mode, cu_seqlens=cu, seq_axis="bshd")
    my_tokens, my_labels = (ring.shard(x.numpy(), axis=-1) for x in (tokens, labels))
    my_positions = torch.from_numpy(position_ids(ring.positions, cu))
    all_positions = torch.from_numpy(position_ids(np.arange(SEQ), cu))
    loss_err = param_err = 0.0
    with ring:
        for step in range(steps):
            # context parallel: this rank's tokens, the loss of its labels, gradients summed over ranks
            optimizer.zero_grad()
            logits = model(torch.from_numpy(my_tokens), my_positions, lambda q, k, v: mpiring.torch.ring_attention(
                q, k, v, ring))
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), torch.from_numpy(my_labels).reshape(-1),
                                   ignore_index=-100, reduction="sum") / valid
            loss.backward()
            for p in model.parameters():
                comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
            total = comm.allreduce(loss.item(), op=MPI.SUM)
            optimizer.step()
            # single process: whole sequences, PyTorch's attention
            ref_optimizer.zero_grad()
            ref_logits = reference(tokens, all_positions, sdpa(reference_mask(cu)))
            ref_loss = F.cross_entropy(ref_logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
            ref_loss.backward()
            ref_optimizer.step()
            loss_err = max(loss_err, abs(total - ref_loss.item()) / abs(ref_loss.item()))
            if comm.rank == 0:
                print(f"  step {step}: loss {total:.12f}  single process {ref_loss.item():.12f}")
    for p, r in zip(model.parameters(), reference.parameters()):
        param_err = max(param_err, float((p - r).detach().abs().max()))
    return comm.allreduce(loss_err, op=MPI.MAX), comm.allreduce(param_err, op=MPI.MAX)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="zigzag", choices=[*mpiring.LAYOUTS, "all"])
    parser.add_argument("--mode", default="ring", choices=[*mpiring.MODES, "all"])
    parser.add_argument("--documents", action="store_true", help="packed documents, position ids per document")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    layouts = mpiring.LAYOUTS if args.layout == "all" else [args.layout]
    modes = mpiring.MODES if args.mode == "all" else [args.mode]
    ok = True
    for layout, mode in itertools.product(layouts, modes):
        if comm.rank == 0:
            print(f"P={comm.size} {layout} {mode}{' documents' if args.documents else ''}: "
                  f"{args.steps} AdamW steps, float64")
        loss_err, param_err = train(comm, layout, mode, args.documents, args.steps)
        passed = loss_err <= 1e-10 and param_err <= 1e-9
        ok &= passed
        if comm.rank == 0:
            print(f"  loss relative error {loss_err:.1e} (<= 1e-10), parameters max error {param_err:.1e} (<= 1e-9): "
                  f"{'ok' if passed else 'FAILED'}")
    if comm.rank == 0:
        print("VERIFIED: context-parallel training matches single-process training" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
