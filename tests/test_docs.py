"""Docs that cannot rot: the configuration reference is generated from the code, every relative link and anchor of the
README and the docs resolves, every metric the code logs is documented, and the pages keep the shape a reader needs
(a README that lands, reference pages without dated history)."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "README.md", *DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a markdown page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading numbered."""
    seen: dict[str, int] = {}
    result = set()
    for line in prose_lines(page.read_text()):
        heading = re.match(r"#{1,6} (.+)", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        result.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return result


def relative_links(page: Path) -> list[str]:
    return [target for line in prose_lines(page.read_text()) for target in LINK.findall(line)
            if not re.match(r"[a-z]+:", target)]


def test_the_configuration_reference_is_what_the_code_generates():
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_configuration

    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render_configuration.render(), (
        "docs/configuration.md differs from OBLRPOConfig's fields: run python scripts/render_configuration.py")


def test_every_option_is_in_the_reference():
    import dataclasses

    from oblr_trl.training.options import OBLRPOOptions

    reference = anchors(ROOT / "docs" / "configuration.md")
    assert {f.name for f in dataclasses.fields(OBLRPOOptions)} <= reference


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        assert linked.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            assert linked.suffix == ".md", f"{page.name}: anchor on a file that is not markdown: {target}"
            assert anchor in anchors(linked), f"{page.name}: link to {target}: no such heading in {linked.name}"


def test_the_link_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Choosing δ for your model\n\n```bash\n# not a heading\n```\n")
    (tmp_path / "b.md").write_text("[ok](a.md#choosing-δ-for-your-model) [web](https://x.org/#y) "
                                   "[missing](c.md) [bad anchor](a.md#not-a-heading)\n")
    assert anchors(tmp_path / "a.md") == {"title", "choosing-δ-for-your-model"}
    assert relative_links(tmp_path / "b.md") == ["a.md#choosing-δ-for-your-model", "c.md", "a.md#not-a-heading"]


def test_every_logged_metric_is_documented():
    logged = set()
    for module in (ROOT / "oblr_trl").rglob("*.py"):
        logged |= set(re.findall(r"metrics\[\"([a-z_]+/[a-z_/]+)\"\]", module.read_text()))
    assert len(logged) > 20
    documented = (ROOT / "docs" / "metrics.md").read_text()
    assert not {name for name in logged if f"`{name}`" not in documented}


def test_the_readme_lands():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 120
    first = "\n".join(lines[:40])
    assert "pip install" in first and "from oblr_trl import OBLRPOConfig, OBLRPOTrainer" in first
    assert not DATE.search(text), DATE.search(text)
    assert "python -m pytest" in text and "oblr-trl train" in text


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_reference_pages_are_short_and_undated(page):
    text = page.read_text()
    assert len(text.splitlines()) <= 300
    assert not re.search(r"default (until|since)", text, re.IGNORECASE)
    dated = [line for line in prose_lines(text) if line.startswith("#") and DATE.search(line)]
    assert not dated, dated


# the defaults the prose quotes, each with the words around it, so that a changed default fails here until the prose
# says the new one
QUOTED_DEFAULTS = [
    (r"δ = (\d[\d.]*)\b", lambda d: [d["lr_trust_region_kl"]]),
    (r"within (\d[\d.]*)–(\d[\d.]*)×", lambda d: [d["lr_trust_region_min_ratio"], d["lr_trust_region_max_ratio"]]),
    (r"every (\d+)th step", lambda d: [d["lr_trust_region_measure_steps"]]),
    (r"on (\d+) completions", lambda d: [d["lr_trust_region_sample_size"]]),
]
QUOTING = [ROOT / "README.md", *DOCS, ROOT / "recipes" / "quickstart.yaml",
           *sorted((ROOT / "notebooks").glob("*.ipynb"))]


@pytest.mark.parametrize("page", QUOTING, ids=lambda p: str(p.relative_to(ROOT)))
def test_defaults_quoted_in_prose_are_the_codes(page):
    import dataclasses

    from oblr_trl import OBLRPOConfig
    from oblr_trl.estimators.step_rate import RateRuleTuning

    defaults = {f.name: f.default for cls in (OBLRPOConfig, RateRuleTuning) for f in dataclasses.fields(cls)}
    for pattern, expected in QUOTED_DEFAULTS:
        for found in re.findall(pattern, page.read_text()):
            found = found if isinstance(found, tuple) else (found,)
            assert [float(value) for value in found] == [float(v) for v in expected(defaults)], (page.name, pattern)


def test_the_delta_recipe_of_the_rate_rule_gets_the_committed_delta_from_the_committed_runs():
    """docs/rate_rule.md's three steps, followed literally on the committed δ runs of a + b (the defaults without the
    trust region at GRPO's best rate, validation seeds, every step logged): the median of each gradient step's KL
    scaled by (configured ÷ logged `learning_rate`)² is the committed one, and rounds to the δ that ships. Scaling by
    the logged `learning_rate` ÷ `oblr/lr` instead (the recipe as it read before) gives a δ 4× too small."""
    import statistics

    from oblr_trl import OBLRPOConfig

    recipe = (ROOT / "docs" / "rate_rule.md").read_text()
    assert "`logging_steps=1`" in recipe and "whose `grad_norm` is not 0" in recipe
    assert "η_peak the `learning_rate` you configured, η the logged `learning_rate` of that step" in recipe
    results = ROOT / "benchmarks" / "results" / "stability"
    committed = json.loads((results / "summary.json").read_text())["trust_region_delta"]
    runs = [json.loads(path.read_text()) for path in sorted((results / "runs").glob("validation-oblrpo-kl-*.json"))]
    assert [r["seed"] for r in runs] == committed["seeds"] and {r["learning_rate"] for r in runs} == {committed["rate"]}
    scaled, unscaled = [], []
    for run in runs:
        traces = run["traces"]
        used = traces.get("oblr/lr") or traces["snr/effective_lr"]  # the committed runs' name for it
        for kl, logged, grad_norm, rate in zip(traces["oblr/step_kl"], traces["learning_rate"], traces["grad_norm"],
                                                used, strict=True):
            if grad_norm != 0 and kl == kl and logged > 0:
                scaled.append(kl * (run["learning_rate"] / logged) ** 2)
                unscaled.append(kl * (logged / rate) ** 2)
    delta = statistics.median(scaled)
    assert delta == pytest.approx(committed["step_kl_at_peak_quartiles"][1], rel=1e-12)
    assert float(f"{delta:.0e}") == OBLRPOConfig.lr_trust_region_kl == 0.005
    assert statistics.median(unscaled) < delta / 3  # 1.2e-3: what the recipe gave as it read before


def test_where_rate_free_stops_quotes_the_committed_summaries():
    """docs/rate_rule.md's figures for TRL's 1e-6 (share of gradient steps at the 10× bound, the rate asked for ÷ the
    scheduled one) are the committed summaries' (`rate_rule_traces`), for sums and for sums answered step by step."""
    text = " ".join((ROOT / "docs" / "rate_rule.md").read_text().split())
    quoted = re.search(r"sat at 10× on (\d+) % of the steps with a gradient, the trust region asking for (\d+)× .*? it sat "
                       r"there on (\d+) %, asking for (\d+)×", text)
    assert quoted, "the paragraph on where rate-free stops moved"
    measured = []
    for folder in ("stability", "stability-long"):
        summary = json.loads((ROOT / "benchmarks" / "results" / folder / "summary.json").read_text())
        cell = summary["rate_rule"]["oblrpo-trust-peak-update-every16-kl0.005"]["by_rate"]["1e-06"]
        measured += [round(100 * cell["at_upper_bound"]), round(cell["asked_over_scheduled_median"])]
    assert [int(value) for value in quoted.groups()] == measured


def test_the_low_side_figures_quote_the_committed_long_task_summary():
    """docs/rate_rule.md's test-seed figures for the trust region bounded at 100× at TRL's 1e-6 on long answers (its
    mean final accuracy ÷ the grid's best cell, the rate used ÷ the configured rate beside the defaults' at GRPO's best
    rate, and the share of the summed rate on steps without a gradient) are the committed summary's."""
    text = " ".join((ROOT / "docs" / "rate_rule.md").read_text().split())
    quoted = re.search(r"it ended (\d\.\d+) \[\S+ \S+\], (\d\.\d+)× the grid's best cell, .*?the rate used a mean "
                       r"(\d+\.\d)× the configured 1e-6, against (\d\.\d+)× the configured 3e-5\), and yet the "
                       r"defaults there end (\d\.\d+)\. .*? those steps carry (\d+) % of a run's summed rate, against "
                       r"(\d+) % at 3e-5", text)
    assert quoted, "the paragraph on the 100× bound moved"
    summary = json.loads((ROOT / "benchmarks" / "results" / "stability-long" / "summary.json").read_text())
    bound, defaults = "oblrpo-trust-bound100", "oblrpo-trust-peak-update-every16-kl0.005"
    low_side = summary["smollm2"]["low_side_range"][bound]["1e-06"]
    at_low, at_best = summary["rate_rule"][bound]["by_rate"]["1e-06"], summary["rate_rule"][defaults]["by_rate"]["3e-05"]
    measured = [f"{low_side['final_mean']:.3f}", f"{low_side['of_best_cell']:.2f}",
                f"{at_low['used_over_configured_mean']:.1f}", f"{at_best['used_over_configured_mean']:.2f}",
                f"{summary['smollm2']['defaults_range']['3e-05']['final_mean']:.3f}",
                f"{100 * at_low['without_gradient_share_mean']:.0f}", f"{100 * at_best['without_gradient_share_mean']:.0f}"]
    assert list(quoted.groups()) == measured
