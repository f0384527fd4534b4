"""cost/ tells the strategies apart in one module: ``cost.by_strategy``, a table keyed by ``plan.strategy``.

    python -m pytest -q tests/test_strategy_table.py
"""

import re
from pathlib import Path

import pytest

from mpiring.cost.by_strategy import STRATEGIES, strategy_of
from mpiring.cost.costmodel import TIME_VARIANTS
from mpiring.plans.make import make_plan
from mpiring.plans.plan import ALL_MODES, MODES

COST = Path(__file__).resolve().parent.parent / "mpiring" / "cost"
NAMES = "|".join(ALL_MODES + ("grid", "hybrid"))
# a mode looked at: plan.mode, "mode in ...", a plan class, or a strategy's name compared (infercost's decode
# merges, "tree" or "ring", are not strategies)
LOOKS = re.compile(rf"\.mode\b|(?<!for )\bmode\s+(not\s+)?in\b|isinstance\([^)]*Plan\b|HEAD_MODES|"
                   rf"(?<!merge )[=!]=\s*[\"'](?:{NAMES})[\"']|[\"'](?:{NAMES})[\"']\s*[=!]=")


def test_only_the_table_looks_at_the_strategy():
    """No other module of cost/ compares modes, plan classes or strategy names."""
    found = [f"{path.name}:{n}: {line.strip()}" for path in sorted(COST.glob("*.py")) if path.name != "strategies.py"
             for n, line in enumerate(path.read_text().splitlines(), 1) if LOOKS.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("options", [{"mode": m} for m in ALL_MODES] + [{"mode": m, "ulysses_size": 2} for m in MODES])
def test_every_plan_has_an_entry(options):
    plan = make_plan(16, 4, **options)
    assert strategy_of(plan) is STRATEGIES[plan.strategy]


def test_the_time_variants_are_the_tables():
    assert TIME_VARIANTS == ("contiguous", "zigzag", "striped", "bidirectional", "allgather")
