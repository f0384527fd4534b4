"""Bytes moved for a zoo of masks: the sparse movement against the minimum, the ring and the all-gather, measured.

    mpiexec -n 4 python -m mpiring bench zoo                 # the table at P = 4, on rank 0
    mpiexec -n 8 python -m mpiring bench zoo --markdown      # the rows of docs/balance.md §7 at P = 8

Every mask of ``zoo_masks`` (over ``TOKENS`` tokens per rank), contiguous and
zigzag, runs forward and backward under each movement (``MOVEMENTS``). Each
rank's recorded bytes must equal the cost model's prediction
(``nodes.predicted_bytes``): the command exits 1 if one does not. The table
gives the sums over the ranks: the minimum (each rank receives, once, every
other rank's block that its queries see, found from the masks' definition,
not from a plan), then what each movement sent, forward (K/V) and backward
(K/V and the dK/dV partials).
"""

import numpy as np

from mpiring import ring_attention, ring_attention_backward, shard_indices
from mpiring.core.record import Record
from mpiring.core.reference import definition_mask
from mpiring.cost.nodes import predicted_bytes

from ..cli import command_parser, table_text

__all__ = ["TOKENS", "SHAPE", "MOVEMENTS", "zoo_masks", "minimum_bytes", "measure", "rows", "render",
           "zoo", "zoo_parser"]

TOKENS = 16  # tokens per rank
SHAPE = dict(batch=1, hq=2, hk=1, dim=8, dim_v=8, itemsize=4)  # float32: 64 bytes of K and V per token
MOVEMENTS = {"sparse": "sparse", "ring": "ring", "all-gather": "allgather"}  # column -> mode
LAYOUTS = ("contiguous", "zigzag")


def zoo_masks(S):
    """Name -> ``ring_attention`` mask options over S tokens (S = TOKENS * P)."""
    n = S // 16  # a sixteenth of the sequence: a shard at P = 16, two shards at P = 8, ...

    def docs(*cuts):
        return np.array(sorted({0, S, *cuts}))

    return {
        "full": {},
        "causal": dict(causal=True),
        "window 4": dict(causal=True, window=(4, 0)),
        "window 16": dict(causal=True, window=(16, 0)),
        "window 40": dict(causal=True, window=(40, 0)),
        "window 8 both sides": dict(window=(8, 8)),
        "documents of 8": dict(causal=True, cu_seqlens=np.arange(0, S + 1, 8)),
        "documents of 24": dict(causal=True, cu_seqlens=docs(*range(24, S, 24))),
        "documents 1/8, 3/8, 1/2": dict(causal=True, cu_seqlens=docs(2 * n, 8 * n)),
        "frames of 8": dict(causal=True, causal_block=8),
        "frames of 32": dict(causal=True, causal_block=32),
        "window 8 + documents of 24": dict(causal=True, window=(8, 0), cu_seqlens=docs(*range(24, S, 24))),
    }


def minimum_bytes(S, P, layout, mask, shape=SHAPE):
    """Forward K/V bytes if each rank receives exactly the blocks its queries see, once (from ``definition_mask``)."""
    pos = np.arange(S)
    seen = definition_mask(pos, pos, **mask)
    shards = [shard_indices(S, P, r, layout) for r in range(P)]
    per_token = shape["batch"] * shape["hk"] * (shape["dim"] + shape["dim_v"]) * shape["itemsize"]
    return sum(len(shards[j]) * per_token for r in range(P) for j in range(P)
               if j != r and seen[np.ix_(shards[r], shards[j])].any())


def measure(comm, S, layout, mask, mode, seed=0):
    """``(forward, backward)`` bytes this rank sent under ``mode``, and whether each equals the prediction."""
    P, rank = comm.Get_size(), comm.Get_rank()
    rng = np.random.default_rng(seed)  # whole arrays from one seed on every rank, then this rank's rows
    b, hq, hk, d, dv = (SHAPE[k] for k in ("batch", "hq", "hk", "dim", "dim_v"))
    Q, dO = (rng.standard_normal((b, hq, S, w)).astype(np.float32) for w in (d, dv))
    K, V = (rng.standard_normal((b, hk, S, w)).astype(np.float32) for w in (d, dv))
    rows = shard_indices(S, P, rank, layout)
    q, k, v, do = (np.ascontiguousarray(a[..., rows, :]) for a in (Q, K, V, dO))
    fwd, bwd = Record(), Record()
    options = dict(layout=layout, mode=mode, **mask)
    out, lse = ring_attention(q, k, v, comm, record=fwd, **options)
    ring_attention_backward(do, q, k, v, out, lse, comm, record=bwd, **options)
    want = (predicted_bytes(fwd.plan, **SHAPE)[rank], predicted_bytes(fwd.plan, **SHAPE, backward=True)[rank])
    return (fwd.bytes_sent, bwd.bytes_sent), (fwd.bytes_sent, bwd.bytes_sent) == want


def rows(comm, names=None):
    """The table's rows at this P: ``(mask, layout, minimum, {column: (forward, backward)})``, sums over the
    ranks (the same on every rank), and whether every rank's bytes equalled its prediction."""
    P = comm.Get_size()
    S = TOKENS * P
    masks = zoo_masks(S)
    found, predicted = [], True
    for name in names or masks:
        for layout in LAYOUTS:
            sent = {}
            for column, mode in MOVEMENTS.items():
                mine, ok = measure(comm, S, layout, masks[name], mode)
                every = comm.allgather((mine, ok))
                predicted &= all(o for _, o in every)
                sent[column] = tuple(sum(m[i] for m, _ in every) for i in (0, 1))
            found.append((name, layout, minimum_bytes(S, P, layout, masks[name]), sent))
    return found, predicted


def render(found, P, markdown=False):
    """The rows as a table: bytes summed over the ranks, forward then backward."""
    head = (["P", "mask", "layout", "minimum"] + [f"{c} fwd" for c in MOVEMENTS] + [f"{c} bwd" for c in MOVEMENTS]
            + ["sparse/minimum", "sparse/ring fwd"])
    body = []
    for name, layout, least, sent in found:
        body.append([str(P), name, layout, str(least)] + [str(sent[c][0]) for c in MOVEMENTS]
                    + [str(sent[c][1]) for c in MOVEMENTS]
                    + [_ratio(sent["sparse"][0], least), _ratio(sent["sparse"][0], sent["ring"][0])])
    return table_text(head, body, markdown)


def _ratio(a, b):
    return "-" if b == 0 else f"{a / b:.2f}"


def zoo_parser():
    p = command_parser("bench zoo", zoo)
    p.add_argument("--markdown", action="store_true", help="the rows as a Markdown table (docs/balance.md)")
    p.add_argument("--mask", action="append", help="only this mask of the zoo (repeatable)")
    return p


def zoo(comm, args=None):
    """Bytes each movement sends for a zoo of masks, measured, against the minimum and the cost model."""
    args = zoo_parser().parse_args(args)
    P = comm.Get_size()
    unknown = sorted(set(args.mask or ()) - set(zoo_masks(TOKENS * P)))
    if unknown:
        raise SystemExit(f"unknown masks {unknown}: the zoo has {', '.join(zoo_masks(TOKENS * P))}")
    found, predicted = rows(comm, args.mask)
    if comm.Get_rank() == 0:
        print(render(found, P, args.markdown))
        print(f"\nP = {P}, {TOKENS} tokens per rank, K/V {SHAPE['batch'] * SHAPE['hk']} head(s) of "
              f"{SHAPE['dim']} + {SHAPE['dim_v']} float32; bytes summed over the ranks. Every rank's measured "
              f"bytes {'equal' if predicted else 'DIFFER FROM'} the cost model's (nodes.predicted_bytes).")
    return 0 if predicted else 1
