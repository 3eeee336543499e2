"""The package's own structure (docs/architecture.md): three layers whose imports run one way, no import cycle, and
collaborators that never reach into the trainer."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "oblr_trl"
LAYERS = ("surface", "training", "estimators")  # each imports only from itself and the layers after it


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name relative to it ("cli", "training.trainer"), packages' __init__ as
    the package's name ("training")."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> str:
    return module.split(".")[0] if module.split(".")[0] in LAYERS else "surface"


def _resolve(module: str, node: ast.ImportFrom) -> list[str]:
    """The package modules an ``from … import …`` statement in ``module`` imports (modules or the modules of names)."""
    if node.level:
        path = MODULES[module]
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = package[: len(package) - (node.level - 1)]
    elif (node.module or "").split(".")[0] == "oblr_trl":
        base = []
        node = ast.ImportFrom(module=".".join(node.module.split(".")[1:]) or None, names=node.names, level=1)
    else:
        return []
    stem = base + (node.module.split(".") if node.module else [])
    targets = []
    for alias in node.names:
        candidate = ".".join([*stem, alias.name])
        targets.append(candidate if candidate in MODULES else ".".join(stem))
    return [target for target in targets if target in MODULES and target != ""]


def _imports(module: str, with_type_checking: bool) -> set[str]:
    """The package modules ``module`` imports (at the top or inside functions); with ``with_type_checking`` also those
    imported only for type hints."""
    tree = ast.parse(MODULES[module].read_text())
    type_checking = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (with_type_checking or id(node) not in type_checking):
            found.update(_resolve(module, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                name = ".".join(alias.name.split(".")[1:])
                if alias.name.split(".")[0] == "oblr_trl" and name in MODULES:
                    found.add(name)
    found.discard(module)
    return found


def test_the_module_finder_sees_what_the_package_imports():
    """The finder the other tests rely on: relative, parent-relative, package and absolute imports."""
    assert {"arguments", "training.trainer", "training.model_card", "training.models", "tasks"} <= _imports(
        "cli", False
    )
    assert {"estimators.advantages", "estimators.baselines", "training.models", "training.completion_weights"} <= _imports(
        "training.trainer", False
    )
    assert _imports("estimators.trust_region", False) == {"estimators.snr"}
    assert _imports("estimators.step_rate", False) == {
        "estimators.choices", "estimators.snr", "estimators.trust_region"
    }


def test_no_import_cycle_in_the_package():
    graph = {module: _imports(module, False) for module in MODULES if "." in module or module not in LAYERS}
    graph.pop("", None)
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for imported in sorted(graph.get(module, ())):
            assert state.get(imported) != "open", " -> ".join([*trail, module, imported])
            if imported not in state:
                visit(imported, [*trail, module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m))
def test_imports_run_from_the_surface_to_training_to_the_estimators(module):
    """A module imports from its own layer and the layers below it only, type hints included."""
    allowed = LAYERS[LAYERS.index(_layer(module)):]
    upward = sorted(m for m in _imports(module, True) if _layer(m) not in allowed)
    assert not upward, f"{module} ({_layer(module)}) imports {upward} from a layer above it"


def test_the_estimators_import_torch_and_nothing_of_trl_or_transformers():
    for module, path in MODULES.items():
        if _layer(module) != "estimators":
            continue
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and not node.level}
        third_party = {name.split(".")[0] for name in names} - {"torch", "math", "dataclasses", "collections",
                                                                  "typing", "__future__", "functools"}
        assert not third_party, f"{module} imports {sorted(third_party)}"


def test_nothing_the_trainer_imports_imports_the_trainer_back():
    """Collaborators are handed what they use; none knows the trainer, not even as a type hint."""
    seen, todo = set(), ["training.trainer"]
    while todo:
        for imported in _imports(todo.pop(), True):
            if imported not in seen:
                seen.add(imported)
                todo.append(imported)
    back = sorted(module for module in seen if "training.trainer" in _imports(module, True))
    assert not back, f"{back} import the trainer back"
    assert "training.trainer" not in seen


def test_the_recorders_measure_and_only_the_step_control_applies_the_rate_rule():
    """The rate of a step is decided in `estimators.step_rate` alone: the recorders neither import the rule's parts
    nor one another, and the step control never imports a recorder (it is handed the KL measurement as a function)."""
    parts = {"estimators.snr", "estimators.trust_region", "estimators.step_rate"}
    recorders = {"training.step_kl", "training.step_noise"}
    for module in recorders:
        assert not _imports(module, True) & (recorders | {"training.step_control"}), module
        assert "estimators.step_rate" not in _imports(module, True), module
    assert not _imports("training.step_control", True) & recorders
    assert {"estimators.step_rate", "estimators.trust_region"} <= _imports("training.step_control", True)
    assert not _imports("training.step_kl", True) & (parts - {"estimators.trust_region"})  # k3 only


def _private_trainer_accesses(tree: ast.AST) -> list[str]:
    """``trainer._x`` or ``….trainer._x`` (private, not dunder) anywhere in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "trainer") or (
            isinstance(owner, ast.Attribute) and owner.attr == "trainer"
        ):
            found.append(f"{ast.unparse(node)} (line {node.lineno})")
    return found


def test_no_module_but_the_trainer_touches_a_private_member_of_the_trainer():
    """TRL's private names are read in one place, `training/trainer.py`, so that a TRL upgrade is read there."""
    assert _private_trainer_accesses(ast.parse("trainer._metrics; self.trainer._paper; trainer.args; x._y")) == [
        "trainer._metrics (line 1)", "self.trainer._paper (line 1)"
    ]
    offenders = {module: found for module, path in MODULES.items() if module != "training.trainer"
                 for found in [_private_trainer_accesses(ast.parse(path.read_text()))] if found}
    assert not offenders, offenders


def test_the_vllm_extra_asks_for_the_versions_the_pinned_trl_supports():
    """`pip install ".[vllm]"` must not install a vLLM that TRL warns about: the extra's range is TRL's own."""
    import configparser
    import importlib.util
    import re

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parents[1] / "setup.cfg")
    extra = setup["options.extras_require"]["vllm"].strip()
    source = Path(importlib.util.find_spec("trl.import_utils").origin).read_text()
    supported = re.search(r"supports vLLM versions from (\d+(?:\.\d+)*) to (\d+(?:\.\d+)*)", source)
    low, high = supported.groups()
    assert extra == f"vllm>={low.removesuffix('.0')},<={high}", (extra, low, high)
