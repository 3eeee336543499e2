"""The package's own structure: modules import each other without a cycle (TYPE_CHECKING-only imports aside)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "oblr_trl"


def _imported_modules(path: Path) -> set[str]:
    """The oblr_trl modules ``path`` imports at run time (at the top or inside functions)."""
    tree = ast.parse(path.read_text())
    type_checking = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(node.module.split(".")[0])
            else:
                found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("oblr_trl."):
            found.add(node.module.split(".")[1])
    return {name for name in found if (PACKAGE / f"{name}.py").exists()}


def test_no_import_cycle_in_the_package():
    graph = {path.stem: _imported_modules(path) for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
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
    assert graph["trainer_fields"] == set()  # the CLI's early check reads it without the rest of the package
