"""Flat ring, double ring, Ulysses and ring x Ulysses on the emulated cluster at several link rates, next to
the two-level time model (docs/cluster.md section 4).

    .venv/bin/python -m mpiring bench cluster --hosts 2 --per-host 2 --links 100mbit 1gbit    # as root

Per link rate: ``run/cluster up``, ``python -m mpiring run`` (verified) for every mode across the hosts,
``run/cluster down`` (also on failure). Rows in Markdown: wall, the most any rank was blocked, the bytes the
hosts put on their links against the model's inter-node payload, the prediction of ``cluster_model`` with the
FLOP rate each run measured.
"""

import os
import re
import subprocess
import sys

from mpiring import make_plan
from mpiring.cost.cluster_model import cluster_time, emulated

from ..cli import command_parser

__all__ = ["measure", "cluster", "cluster_parser"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CLUSTER = os.path.join(ROOT, "run", "cluster")
INTRA_BETA = 3.8e9  # bytes/s between two ranks of one host: run's calibration on the development VM


def _rate_bits(text):
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", text)
    return float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]


def measure(out):
    """What a ``run`` report says: wall, blocked, measured and model inter-node bytes, kernel GFLOP/s."""
    wall = float(re.search(r"^wall time ([\d.]+) s", out, re.M)[1])
    rows = re.findall(r"^\s+\d+\s+\d+\s+\d+\s+\d+\s+[\d.]+\s+([\d.]+)$", out, re.M)  # rank  sent  predicted ...
    table = out[out.index("node  ranks  measured sent"):]
    nodes = re.findall(r"^\s+\d+\s+[\d,]+\s+(\d+)\s+(\d+)$", table, re.M)
    gflops = float(re.search(r"attention kernel ([\d.]+) GFLOP/s", out)[1])
    return {"wall": wall, "blocked": max(map(float, rows)), "measured": sum(int(m) for m, _ in nodes),
            "model": sum(int(p) for _, p in nodes), "gflops": gflops, "verified": "\nVERIFIED" in out}


def cluster_parser():
    p = command_parser("bench cluster", cluster)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--links", nargs="+", default=["100mbit", "1gbit"])
    p.add_argument("--modes", nargs="+", default=["ring", "double_ring", "ulysses", "hybrid"],
                   help="hybrid: ring x Ulysses with Ulysses inside each host (--ulysses-size = --per-host)")
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    return p


def cluster(comm=None, args=None):
    """Ring, double ring and Ulysses on the emulated cluster at several link rates, against the time model."""
    args = cluster_parser().parse_args(args)
    ranks = args.hosts * args.per_host
    shape = dict(batch=1, hq=args.heads, hk=args.heads, dim=args.dim, dim_v=args.dim, itemsize=4)
    print(f"P={ranks} ({args.hosts} hosts x {args.per_host}), seq_len={args.seq_len}, heads={args.heads}, "
          f"dim={args.dim}, float32, causal, zigzag")
    print("| link | mode | wall s | blocked s (max rank) | inter-node MB measured / model | predicted s "
          "(total / exposed comm) |")
    print("|---|---|---|---|---|---|")
    for link in args.links:
        subprocess.run([CLUSTER, "down"], capture_output=True)
        try:
            subprocess.run([CLUSTER, "up", str(args.hosts), "--link", link], check=True, capture_output=True)
            for mode in args.modes:
                options = (["--mode", "ring", "--ulysses-size", str(args.per_host)] if mode == "hybrid"
                           else ["--mode", mode])
                cmd = [CLUSTER, "run", "-n", str(ranks), sys.executable, "-m", "mpiring", "run", "--seq-len",
                       str(args.seq_len), "--heads", str(args.heads), "--dim", str(args.dim), "--causal",
                       "--layout", "zigzag", *options]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if done.returncode != 0:
                    print(f"| {link} | {mode} | failed (exit {done.returncode}) | | | |")
                    continue
                m = measure(done.stdout)
                grid = dict(mode="ring", ulysses_size=args.per_host) if mode == "hybrid" else dict(mode=mode)
                plan = make_plan(args.seq_len, ranks, layout="zigzag", causal=True, node_size=args.per_host, **grid)
                cluster = emulated(args.hosts, args.per_host, _rate_bits(link), m["gflops"] * 1e9, INTRA_BETA)
                pred = cluster_time(plan, cluster, **shape)
                print(f"| {link} | {mode}{'' if m['verified'] else ' (NOT VERIFIED)'} | {m['wall']:.2f} | "
                      f"{m['blocked']:.2f} | {m['measured'] / 1e6:.1f} / {m['model'] / 1e6:.1f} | "
                      f"{pred['total']:.2f} / {pred['exposed']:.2f} |", flush=True)
        finally:
            subprocess.run([CLUSTER, "down"], capture_output=True)
    return 0
