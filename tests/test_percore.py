"""``python -m mpiring bench percore``: the kernel's three steps on its tiles compute what they say; the table.

    python -m pytest -q tests/test_percore.py
"""

import math
import re
import subprocess
import sys

import numpy as np
import pytest

from mpiring.core.kernels import LOG2E
from mpiring.core.tiles import pad_ones
from mpiring.tools.bench.micro import kernel_steps


@pytest.mark.parametrize("seq, tiles", [(8, (8, 8)), (24, (8, 8)), (24, (16, 4)), (20, (8, 6))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_steps_add_up_every_tile(seq, tiles, dtype):
    """acc rows r = sum over query tiles a and key tiles of exp2(c2 q_(a+r) . k) [v | 1]: every tile once."""
    rng = np.random.default_rng(3)
    h, d = 2, 4
    q, k, v = (rng.standard_normal((h, seq, d)).astype(dtype) for _ in range(3))
    scale = 1 / math.sqrt(d)
    run, acc = kernel_steps(q, pad_ones(k), pad_ones(v), scale, *tiles)
    run()
    tq = tiles[0]
    p = np.exp2(scale * LOG2E * (q.astype(np.float64) @ np.swapaxes(k, 1, 2)))
    full = p @ np.concatenate([v, np.ones((h, seq, 1))], axis=-1)          # (h, seq, d + 1)
    want = np.zeros((h, min(tq, seq), d + 1))
    for a in range(0, seq, tq):
        n = min(a + tq, seq) - a
        want[:, :n] += full[:, a:a + n]
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(acc, want, rtol=tol, atol=tol)


def test_command_table():
    run = subprocess.run([sys.executable, "-m", "mpiring", "bench", "percore", "--seq", "96", "--heads", "2",
                          "--dim", "8", "--repeats", "1", "--no-torch"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("one core of ") and ": 2 heads x 96 queries x 96 keys, D=8, float32, full mask; " \
        "GEMMs: " in lines[0]
    rows = {}
    for line in lines[2:]:
        m = re.match(r"  (.+?)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+(\d+%|-)$", line)
        if m:
            rows[m.group(1)] = [float(x) for x in m.groups()[1:4]]
    assert list(rows) == ["the matmul+exp limit", "the kernel's three steps on its tiles",
                          "the kernel (attention_block), numpy"]
    assert rows["the matmul+exp limit"][2] == 1.0
    assert all(ms > 0 and gf > 0 and of > 0 for ms, gf, of in rows.values())
    assert "torch" not in run.stdout
    bad = subprocess.run([sys.executable, "-m", "mpiring", "bench", "percore", "--seq", "0"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--seq must be at least 1" in bad.stderr
