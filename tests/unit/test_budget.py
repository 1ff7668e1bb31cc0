"""``max_memory`` is parsed once into a :class:`Budget` whose shares have names."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import reshard_svc
from reshard_svc.errors import UsageError
from reshard_svc.jobs.spec import ConvertSpec
from reshard_svc.plan.budget import DEFAULTS, Budget

ROOT = Path(reshard_svc.__file__).parent


@pytest.mark.parametrize(
    ("value", "total"),
    [("1GiB", 1 << 30), ("512MB", 512 * 10**6), ("1e9", 10**9), (4096, 4096), ("2Gi", 2 << 30)],
)
def test_a_budget_is_what_was_typed(value, total):
    assert Budget.of(value, "convert").total == total


def test_each_verb_has_one_default():
    assert Budget.of(None, "convert").total == DEFAULTS["convert"] == 1 << 30
    assert Budget.of(None, "load").total == DEFAULTS["load"] == 512 << 20
    assert Budget.of(None, "transfer").total == DEFAULTS["transfer"] == 512 << 20
    budget = Budget(1000)
    assert Budget.of(budget, "load") is budget


def test_the_shares_are_named_and_never_zero():
    b = Budget(1 << 30)
    assert (b.band, b.writer, b.buffers) == (1 << 28, 1 << 28, 1 << 29)
    tiny = Budget(1)
    assert min(tiny.band, tiny.writer, tiny.buffers) == 1


@pytest.mark.parametrize("bad", [0, -5, True, "abc", "0GiB", 1.5])
def test_a_bad_budget_names_max_memory(bad):
    with pytest.raises(UsageError, match="max_memory"):
        Budget.of(bad, "load") if not isinstance(bad, float) else Budget(bad)  # type: ignore[arg-type]


def test_the_spec_parses_its_budget_in_one_place():
    spec = ConvertSpec(source="a", target="b", max_memory="64MiB").checked()
    assert spec.budget().total == 64 << 20
    assert ConvertSpec(source="a", target="b").budget("load").total == DEFAULTS["load"]
    with pytest.raises(UsageError, match="max_memory"):
        ConvertSpec(source="a", target="b", max_memory="lots").checked()


def test_no_module_cuts_or_defaults_a_budget_itself():
    """Shares are Budget's properties and defaults its DEFAULTS: no ``budget // n`` or
    ``max_memory // n`` and no ``DEFAULT_*MEMORY`` constant anywhere else."""
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "plan" / "budget.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                text = ast.unparse(node.left)
                if "budget" in text or "max_memory" in text:
                    wrong.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
            if (
                isinstance(node, ast.Name)
                and node.id.startswith("DEFAULT_")
                and "MEMORY" in node.id
            ):
                wrong.append(f"{path.name}:{node.lineno} {node.id}")
    assert not wrong, "\n".join(wrong)
