"""Load balancers: which positions each rank holds, chosen for the mask, as data for ``ring_attention(positions=)``.

    parts = mpiring.balance(16 * 512, 4, causal=True, causal_block=512, method="greedy")
    out, lse = ring_attention(q, k, v, causal=True, causal_block=512, positions=parts[rank])

A rank's work is its visible (query, key) pairs: the number of keys each of
its queries may see, summed (``masks.row_work``). Methods:

- ``contiguous``, ``zigzag``, ``striped``: the built-in layouts (``mpiring.plans.layouts``).
- ``headtail``: PyTorch's per-document head-tail: every document is cut into
  2P chunks and rank r takes chunks r and 2P-1-r of each (zigzag per
  document; the rank labels turn by one per document, so short documents do
  not all land on rank 0).
- ``greedy``: documents cut into chunks of about S / (16 P) tokens; the
  chunks, heaviest first, each go to the least-loaded rank (LPT scheduling).
"""

import heapq

import numpy as np

from .layouts import LAYOUTS, block_range, layout_positions
from .make import make_plan
from .visibility import check_causal_block, check_cu_seqlens, check_mask, check_window, row_work

__all__ = ["METHODS", "balance", "work", "imbalance", "GREEDY_CHUNKS", "WORKLOADS", "markdown_table"]

METHODS = LAYOUTS + ("headtail", "greedy")
GREEDY_CHUNKS = 16  # greedy: chunks per rank (more: finer balance, more runs per rank)


def balance(seq_len, size, *, causal=False, window=None, cu_seqlens=None, causal_block=None, method="greedy",
            mask=()):
    """``size`` sorted position arrays that partition range(seq_len), dealt out by ``method`` (see the module)."""
    for name, value in (("seq_len", seq_len), ("size", size)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if seq_len < size:
        raise ValueError(f"need at least one token per rank: seq_len={seq_len}, size={size}")
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    cu = check_cu_seqlens(cu_seqlens, seq_len)
    mask = dict(causal=bool(causal), window=check_window(window), cu_seqlens=cu,
                causal_block=check_causal_block(causal_block, causal), mask=check_mask(mask))
    if method in LAYOUTS:
        return layout_positions(seq_len, size, method)
    docs = [(0, seq_len)] if cu is None else [(int(a), int(b)) for a, b in zip(cu[:-1], cu[1:]) if b > a]
    if method == "headtail":
        parts = _headtail(docs, size)
    else:
        parts = _greedy(docs, size, row_work(seq_len, **mask))
    if min(len(p) for p in parts) == 0:
        raise ValueError(f"{method} leaves a rank without tokens: {seq_len} tokens in {len(docs)} documents over "
                         f"{size} ranks")
    return [np.sort(np.concatenate(p)) for p in parts]


def _headtail(docs, size):
    """Per document: 2P chunks, rank r (turned by the document's index) takes chunks r and 2P-1-r."""
    parts = [[np.empty(0, np.int64)] for _ in range(size)]
    for d, (start, stop) in enumerate(docs):
        for r in range(size):
            for chunk in (r, 2 * size - 1 - r):
                n, s = block_range(stop - start, 2 * size, chunk)
                parts[(r + d) % size].append(np.arange(start + s, start + s + n))
    return parts


def _greedy(docs, size, rows):
    """Chunks of every document, heaviest first, each to the least-loaded rank (ties: fewer tokens, lower rank)."""
    chunk = max(1, sum(b - a for a, b in docs) // (GREEDY_CHUNKS * size))
    pieces = []
    for start, stop in docs:
        count = -(-(stop - start) // chunk)  # near-equal chunks of at most ``chunk`` tokens
        edges = [start + i * (stop - start) // count for i in range(count + 1)]
        pieces += [(int(rows[a:b].sum()), a, b) for a, b in zip(edges, edges[1:])]
    pieces.sort(key=lambda p: (-p[0], p[1]))
    heap = [(0, 0, r) for r in range(size)]  # (work, tokens, rank)
    parts = [[np.empty(0, np.int64)] for _ in range(size)]
    for load, a, b in pieces:
        done, tokens, r = heapq.heappop(heap)
        parts[r].append(np.arange(a, b))
        heapq.heappush(heap, (done + load, tokens + b - a, r))
    return parts


def work(parts, seq_len=None, *, causal=False, window=None, cu_seqlens=None, causal_block=None, mask=()):
    """Visible (query, key) pairs of every rank holding the positions ``parts`` (keys: the whole sequence)."""
    seq_len = sum(len(p) for p in parts) if seq_len is None else seq_len
    rows = row_work(seq_len, causal=causal, window=check_window(window),
                    cu_seqlens=check_cu_seqlens(cu_seqlens, seq_len), causal_block=causal_block, mask=check_mask(mask))
    return [int(rows[np.asarray(p, np.int64)].sum()) for p in parts]


def imbalance(loads):
    """max / mean of per-rank loads (1.0: perfectly balanced)."""
    return max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0


# the workloads of docs/balance.md's table: (name, seq_len, mask options)
WORKLOADS = (
    ("causal", 16384, dict(causal=True)),
    ("packed documents", 16384, dict(causal=True, cu_seqlens=[0, 9000, 9100, 12000, 12100, 12150, 16000, 16384])),
    ("block-causal video", 16 * 1024, dict(causal=True, causal_block=1024)),
    ("windowed", 16384, dict(causal=True, window=(1024, 0))),
)


def markdown_table(size, workloads=WORKLOADS, computed=False):
    """max/mean work of every method (rows) on every workload (columns), as a Markdown table.

    Work is visible pairs; with ``computed``, the busiest rank's computed pairs
    (what ``make_plan``'s pieces give the kernel) over the mean visible pairs.
    """
    lines = ["| method | " + " | ".join(name for name, _, _ in workloads) + " |",
             "|---|" + "---:|" * len(workloads)]
    for method in METHODS:
        cells = []
        for _, n, mask in workloads:
            parts = balance(n, size, method=method, **mask)
            visible = work(parts, n, **mask)
            busiest = max(make_plan(n, size, positions=parts, **mask).computed_pairs()) if computed else max(visible)
            cells.append(f"{busiest / (sum(visible) / size):.3f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
