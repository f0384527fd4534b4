"""The command line's verification shares no code with what it verifies.

    python -m pytest -q tests/test_verify_independent.py

A broken mask inside the ring (here: windows ignored, or window ends that wrap
around 64 bits as they once did) must make ``run`` report VERIFICATION FAILED,
because the reference builds its mask from the definitions (mpiring.core.reference).
"""

import numpy as np
import pytest

from mpiring.__main__ import main
from mpiring.core.reference import definition_mask
from mpiring.plans import plan as plans
from mpiring.plans import visibility


def _ignore_window(q_pos, k_pos, *, causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None, mask=()):
    return visibility.visible_keys(q_pos, k_pos, causal=causal, cu_seqlens=cu_seqlens, causal_block=causal_block,
                              mask=mask)


def _wrapping_window(q_pos, k_pos, *, causal=False, window=(-1, -1), cu_seqlens=None, causal_block=None, mask=()):
    """The old overflow: q_pos + right computed in int64 wraps to a negative end."""
    left, right = window
    with np.errstate(over="ignore"):
        hi = np.asarray(q_pos, np.int64) + np.int64(right)
    klo = np.searchsorted(k_pos, np.asarray(q_pos) - (left if left >= 0 else len(k_pos) + max(q_pos)), side="left")
    khi = np.maximum(np.searchsorted(k_pos, hi, side="right"), klo)
    return klo, khi


@pytest.mark.parametrize("broken,window", [(_ignore_window, ["3", "0"]),
                                           (_wrapping_window, ["-1", str(2**63 - 1)])])
def test_a_broken_mask_fails_verification(monkeypatch, capsys, broken, window):
    argv = ["run", "--seq-len", "48", "--heads", "2", "--dim", "8", "--dtype", "float64", "--window", *window]
    assert main(argv) == 0  # the real masks verify
    monkeypatch.setattr(plans, "visible_keys", broken)
    assert main(argv) == 1
    assert "VERIFICATION FAILED" in capsys.readouterr().out


def test_definition_mask_reads_like_the_definitions():
    pos = np.arange(6)
    assert definition_mask(pos, pos, causal=True).sum() == 21
    band = definition_mask(pos, pos, window=(1, 2**70))  # a right window beyond 64 bits: everything right
    assert band[3].tolist() == [False, False, True, True, True, True]
    docs = definition_mask(pos, pos, cu_seqlens=[0, 2, 2, 6])  # an empty middle document
    assert docs[1].tolist() == [True, True, False, False, False, False]
    assert docs[2].tolist() == [False, False, True, True, True, True]


def test_windows_wider_than_any_sequence():
    """A window end near 2**63 means 'unbounded'; beyond 64 bits it is a clear ValueError."""
    from mpiring import make_plan

    plan = make_plan(96, 2, window=(-1, 2**63 - 1))
    assert plan.visible_pairs() == [48 * 96, 48 * 96]
    plan = make_plan(96, 2, causal=True, window=(2**63 - 1, 2**63 - 1))
    assert sum(plan.visible_pairs()) == 96 * 97 // 2
    with pytest.raises(ValueError, match="must fit in 64 bits"):
        make_plan(96, 2, window=(-1, 2**63))


def test_a_failed_verification_names_what_failed(monkeypatch, capsys):
    """A wrong mask fails on its errors, a wrong byte model on its bytes: each line names the check and the rank."""
    from mpiring.tools import cli_run

    argv = ["run", "--seq-len", "48", "--heads", "2", "--dim", "8", "--dtype", "float64", "--window", "3", "0"]
    monkeypatch.setattr(plans, "visible_keys", _ignore_window)
    assert main(argv) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if line.startswith("FAILED ")]
    # the plan's visible pairs come from the whole sequence's key intervals (plans.rows), not from its masks:
    # they catch the wrong mask too
    errors = [line for line in failed if not line.startswith("FAILED visible (query, key) pairs: rank 0 measured")]
    assert errors and all("exceeds the tolerance 1e-10" in line and "on rank 0" in line for line in errors), failed
    assert lines[-1] == f"VERIFICATION FAILED ({len(failed)} check(s) above)"
    monkeypatch.undo()

    predicted = cli_run._predicted
    monkeypatch.setattr(cli_run, "_predicted", lambda *a, **k: [n + 1 for n in predicted(*a, **k)])
    for extra, what in (([], "bytes sent"), (["--backward"], "forward bytes sent")):
        assert main(argv + extra) == 1
        lines = capsys.readouterr().out.splitlines()
        assert any(line.startswith(f"FAILED {what}: rank 0 measured ") and line.endswith(", predicted 1")
                   for line in lines), lines[-5:]
        assert lines[-1].startswith("VERIFICATION FAILED (")
