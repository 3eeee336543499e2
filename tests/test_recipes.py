"""Shipped recipes run the shipping defaults: every OBLR-PO field a recipe sets equals `OBLRPOConfig`'s default, unless
its line says why it differs (a comment beginning "not the default:", which this test reads)."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from oblr_trl import OBLRPOConfig
from oblr_trl.training.options import OBLRPOOptions

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "accelerate_configs" not in p.parts)
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
DIFFERS = "# not the default:"
# OBLR-PO's own fields, and the GRPOConfig field whose default OBLR-PO's docs argue for
OBLRPO_FIELDS = {f.name for f in dataclasses.fields(OBLRPOOptions)} | {"scale_rewards"}


def defaults() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(OBLRPOConfig) if f.name in OBLRPO_FIELDS}


def recipe_lines(text: str) -> dict[str, str]:
    """Top-level key -> its whole line, for the comment beside the value."""
    return {line.split(":", 1)[0]: line for line in text.splitlines() if line and line[0].isalpha() and ":" in line}


def test_the_default_of_every_checked_field_is_known():
    assert set(defaults()) == OBLRPO_FIELDS
    assert defaults()["scale_rewards"] == "group"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT / "recipes")))
def test_every_oblrpo_field_a_recipe_sets_is_the_default_or_says_why_not(recipe):
    text = recipe.read_text()
    values, lines, expected = yaml.safe_load(text), recipe_lines(text), defaults()
    for key in OBLRPO_FIELDS & set(values):
        if values[key] != expected[key]:
            assert DIFFERS in lines[key], (
                f"{recipe.name}: {key}: {values[key]!r} is not OBLRPOConfig's default {expected[key]!r}; set the "
                f"default or say why in a comment '{DIFFERS} …' on that line")
        else:
            assert DIFFERS not in lines[key], f"{recipe.name}: {key} is the default but its comment says it is not"


def test_the_oblrpo_recipes_and_the_quickstart_spell_out_the_trust_region_they_run():
    """A reader of an OBLR-PO recipe sees the rate rule it runs, not an older one."""
    for recipe in RECIPES:
        if "grpo" in recipe.parts[-2]:
            continue
        values = yaml.safe_load(recipe.read_text())
        for key in ("lr_trust_region_kl", "lr_trust_region_sample_size"):
            assert values.get(key) == defaults()[key], (recipe.name, key)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_set_no_oblrpo_field_away_from_its_default_without_saying_why(notebook):
    import ast
    import re

    import nbformat

    source = "\n".join(cell.source for cell in nbformat.read(notebook, as_version=4).cells if cell.cell_type == "code")
    names = "|".join(sorted(OBLRPO_FIELDS))
    for key, value in re.findall(rf"\b({names})\s*=\s*([^,\n)]+)", source):
        if ast.literal_eval(value.strip()) != defaults()[key]:
            line = next(line for line in source.splitlines() if re.search(rf"\b{key}\s*=", line))
            assert DIFFERS in line, (notebook.name, line)
