"""The exercises (labs), their case matrices, and which cases a run selects. No MPI here.

A student's file may say which exercise it is (``EXERCISE = "causal"`` at module level, read
without running the file); ``--exercise`` overrides it, and a file that says nothing is graded
as ``forward``. Each exercise has a list of cases; ``--quick`` keeps four, ``--cases`` keeps those
that match every kind of term given (sizes, dtypes, causal / non-causal).
"""

import ast
import math
import os
from dataclasses import dataclass, field

import numpy as np

__all__ = ["DTYPES", "EXERCISES", "SIZES", "Case", "Exercise", "declared_exercise", "make_cases", "select_terms",
           "student_files"]

SIZES = {  # name: (H, n, D) of each rank's shard; a K or V message is n * H * D * itemsize bytes
    "tiny": (1, 8, 16),  # 1 KiB in float64
    "small": (2, 32, 16),  # 8 KiB
    "medium": (4, 64, 32),  # 64 KiB
    "large": (4, 512, 64),  # 1 MiB
}
DTYPES = (np.float64, np.float32)


@dataclass(frozen=True)
class Exercise:
    name: str
    function: str
    title: str
    signature: str
    kind: str = "forward"  # forward | backward | merge | passq | decode | allreduce
    layout: str = "contiguous"
    causal: tuple = (False, True)
    work: str | None = None  # None | "skip" (causal skipping) | "balance" (zigzag)
    directions: bool = False  # bidirectional: both neighbours, at most floor(P/2) blocks each way
    overlap: bool = False  # every send posted before, and completed after, some of the compute
    heads: str = "any"  # "multiple": H a multiple of P (head-parallel code can be graded)
    heads_per_rank: int = 1  # with heads="multiple": at least this many heads per rank
    group: int = 1  # query heads per K/V head (grouped-query attention)
    traffic: str = "ring"  # the cost model: ring | ulysses | passq | backward | allreduce | tree | none


_RING = "ring_attention(q, k, v, comm, causal=False) -> out"
EXERCISES = {
    "forward": Exercise("forward", "ring_attention", "ring attention, causal and not (any strategy)", _RING,
                        heads="multiple"),
    "merge": Exercise("merge", "merge", "merge two softmax blocks", "merge(out1, lse1, out2, lse2) -> (out, lse)",
                      kind="merge", traffic="none"),
    "ring": Exercise("ring", "ring_attention", "the ring loop (non-causal)", _RING, causal=(False,), overlap=True),
    "causal": Exercise("causal", "ring_attention", "causal skipping", _RING, work="skip"),
    "zigzag": Exercise("zigzag", "ring_attention", "zigzag balance (q, k, v are zigzag shards)", _RING,
                       layout="zigzag", work="balance"),
    "bidirectional": Exercise("bidirectional", "ring_attention", "bidirectional ring", _RING, directions=True),
    "backward": Exercise("backward", "ring_attention_backward", "the backward pass",
                         "ring_attention_backward(dout, q, k, v, out, lse, comm, causal=False) -> (dq, dk, dv)",
                         kind="backward", traffic="backward"),
    "allreduce": Exercise("allreduce", "ring_allreduce", "warm-up: a ring all-reduce (reduce-scatter, all-gather)",
                          "ring_allreduce(x, comm) -> the sum of every rank's x", kind="allreduce",
                          traffic="allreduce"),
    "ulysses": Exercise("ulysses", "ulysses_attention", "Ulysses: all-to-all of heads",
                        "ulysses_attention(q, k, v, comm, causal=False) -> out", heads="multiple", heads_per_rank=2,
                        traffic="ulysses"),
    "decode": Exercise("decode", "decode_attention", "decode against a sharded KV cache, merged as a tree",
                       "decode_attention(q, k_cache, v_cache, comm) -> (out, lse) on rank 0", kind="decode",
                       causal=(False,), traffic="tree"),
    "gqa": Exercise("gqa", "ring_attention", "grouped-query heads on the ring", _RING, group=2),
    "passq": Exercise("passq", "passq_attention", "pass-Q: the queries travel, K/V stay",
                      "passq_attention(q, k, v, comm) -> out", kind="passq", causal=(False,), traffic="passq"),
}


@dataclass(frozen=True)
class Case:
    """One case of an exercise at P ranks: shapes, dtype, mask, seed, and its label."""

    size: str
    dtype: type
    causal: bool
    seed: int
    h: int = 1  # query heads
    n: int = 8  # tokens per rank (K/V rows; queries: q_rows)
    d: int = 16
    kv_heads: int = 1
    q_rows: int = 0  # passq / decode: query rows (0: n)
    extra: dict = field(default_factory=dict, hash=False, compare=False)  # decode: cache lengths; allreduce: N
    name: str = ""  # a label of its own (merge, decode, allreduce)

    @property
    def shape(self):
        return (self.h, self.q_rows or self.n, self.d)

    @property
    def message(self):
        """Bytes of one K (or V) shard: n * Hkv * D * itemsize."""
        return self.kv_heads * self.n * self.d * np.dtype(self.dtype).itemsize

    @property
    def q_message(self):
        return self.h * (self.q_rows or self.n) * self.d * np.dtype(self.dtype).itemsize

    @property
    def label(self):
        if self.name:
            return f"{self.name} ({np.dtype(self.dtype).name})"
        heads = f"H={self.h}" + (f" Hkv={self.kv_heads}" if self.kv_heads != self.h else "")
        rows = f" m={self.q_rows}" if self.q_rows else ""
        return (f"{heads} n={self.n}{rows} D={self.d} {np.dtype(self.dtype).name} "
                f"{'causal' if self.causal else 'non-causal'}")


def _heads(exercise, h, P):
    if exercise.group > 1:
        h = max(h, 2 * exercise.group)
        h = -(-h // exercise.group) * exercise.group
    if exercise.heads == "multiple":
        h = -(-max(h, exercise.heads_per_rank * P) // P) * P
    return h, h // exercise.group


MERGE_NAMES = ["halves", "uneven blocks", "large scores (exp(lse) overflows)", "an empty block (lse = -inf)",
               "both blocks empty", "float32"]
DECODE = [  # name, size, (H, m, D), cache tokens of rank r (of P), dtype
    ("1 query token, equal shards", "tiny", (2, 1, 16), lambda r, P: 8, np.float64),
    ("1 query token, uneven shards", "small", (4, 1, 16), lambda r, P: 5 + 3 * r, np.float64),
    ("4 query tokens, uneven shards", "small", (4, 4, 16), lambda r, P: 17 - 2 * r, np.float64),
    ("the last rank's shard empty", "tiny", (2, 1, 16), lambda r, P: 0 if r == P - 1 else 6, np.float64),
    ("1 query token", "medium", (4, 1, 32), lambda r, P: 64 + r, np.float32),
    ("1 query token", "large", (8, 1, 64), lambda r, P: 512, np.float64),
]
ALLREDUCE = [("N=1000", "tiny", 1000, np.float64), ("N=4099", "small", 4099, np.float64),
             ("N=4099", "small", 4099, np.float32), ("N=65536", "medium", 65536, np.float64),
             ("N=1048579", "large", 1048579, np.float32)]


def _all_cases(exercise, P):
    if exercise.kind == "merge":
        return [Case(name.split(" (")[0], np.float32 if name == "float32" else np.float64, False, 2000 + i, name=name)
                for i, name in enumerate(MERGE_NAMES)]
    if exercise.kind == "decode":
        return [Case(size, dtype, False, 3000 + i, h=h, n=0, d=d, kv_heads=h, q_rows=m, name=name,
                     extra={"lengths": tuple(length(r, P) for r in range(P))})
                for i, (name, size, (h, m, d), length, dtype) in enumerate(DECODE)]
    if exercise.kind == "allreduce":
        return [Case(size, dtype, False, 4000 + i, name=name, extra={"N": N})
                for i, (name, size, N, dtype) in enumerate(ALLREDUCE)]
    cases = []
    for size, (h, n, d) in SIZES.items():
        h, hk = _heads(exercise, h, P)
        for dtype in DTYPES:
            for causal in exercise.causal:
                m = max(1, n // 4) if exercise.kind == "passq" else 0
                cases.append(Case(size, dtype, causal, 1000 + len(cases), h, n, d, hk, m))
    return cases


def select_terms(text):
    """``--cases`` as {kind: {terms}}: sizes, dtypes, "causal"/"non-causal"; ValueError names the valid terms."""
    kinds = {"size": set(SIZES), "dtype": {np.dtype(t).name for t in DTYPES}, "mask": {"causal", "non-causal"}}
    chosen = {}
    for term in (t.strip() for t in text.split(",") if t.strip()):
        kind = next((k for k, names in kinds.items() if term in names), None)
        if kind is None:
            valid = ", ".join(sorted(set().union(*kinds.values())))
            raise ValueError(f"--cases: unknown term {term!r}; valid: {valid}")
        chosen.setdefault(kind, set()).add(term)
    return chosen


def make_cases(exercise, P=1, quick=False, select=None):
    """The exercise's cases at P ranks: all, the four of ``quick``, or those ``select`` (``select_terms``) keeps."""
    cases = _all_cases(exercise, P)
    if select:
        def keep(c):
            values = {"size": c.size, "dtype": np.dtype(c.dtype).name, "mask": "causal" if c.causal else "non-causal"}
            return all(values[kind] in terms for kind, terms in select.items())
        cases = [c for c in cases if keep(c)]
    if quick:
        if exercise.kind in ("merge", "decode", "allreduce"):
            return cases[:4]
        picks = [("tiny", np.float64), ("tiny", np.float32), ("medium", np.float64), ("medium", np.float32)]
        chosen = []
        for i, (size, dtype) in enumerate(picks):
            causal = exercise.causal[i % len(exercise.causal)]
            match = [c for c in cases if (c.size, c.dtype, c.causal) == (size, dtype, causal)]
            chosen += match[:1]
        return chosen
    return cases


def declared_exercise(path):
    """The exercise a student's file names in a module-level ``EXERCISE = "..."`` (read with ast), or None."""
    try:
        tree = ast.parse(open(path).read(), path)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "EXERCISE" for t in node.targets) \
                and isinstance(node.value, ast.Constant) and node.value.value in EXERCISES:
            return node.value.value
    return None


def student_files(paths):
    """Files to grade: each path as given, a folder as its *.py files (sorted, not those starting with _)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(path, f) for f in os.listdir(path)
                            if f.endswith(".py") and not f.startswith("_"))
        else:
            files.append(path)
    return files


def tree_rounds(P):
    """Rounds of a binary-tree merge of P partial results."""
    return math.ceil(math.log2(P)) if P > 1 else 0
