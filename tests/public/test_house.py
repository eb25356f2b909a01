"""The house rules of astage's source: rooms whose imports point one way, modules and
functions small enough to hold in one's head, no friend modules, no hidden side effects on
the host program.  Read from the source files, so they hold for every change."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import grimp
import pytest

import astage

PACKAGE = Path(astage.__file__).resolve().parent
MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60

# torch's own private attributes, and the namedtuple API: what astage may read of objects it
# does not own (docs/design.md: "torch's own aside").
FOREIGN_PRIVATE = {"_cdata", "_base", "_version", "_local_tensor", "_spec", "_replace", "_fields"}
FOREIGN_PRIVATE |= {"_device_types", "_SubParsersAction", "_asdict", "_make"}


def sources() -> Iterator[tuple[Path, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def name_of(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent))


def test_no_module_is_over_800_lines() -> None:
    long = {name_of(p): n for p, _ in sources() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_over_60_lines() -> None:
    long = {
        f"{name_of(path)}:{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for path, tree in sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES  # type: ignore[operator]
    }
    assert long == {}


def test_no_import_circle_between_modules() -> None:
    # Imports for type checking only are no circle at run time.
    graph = grimp.build_graph("astage", exclude_type_checking_imports=True)
    circles = set()
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if graph.find_shortest_chain(importer=imported, imported=module) is not None:
                circles.add(tuple(sorted((module, imported))))
    assert circles == set()


def optional_imports(tree: ast.Module) -> set[int]:
    """Lines of imports inside ``try: ... except ImportError``: an optional dependency
    (obstore, for the remote tier) loaded only by a program that uses it."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
            for h in node.handlers
        ):
            lines |= {n.lineno for stmt in node.body for n in ast.walk(stmt) if isinstance(n, ast.ImportFrom)}
    return lines


def test_no_function_imports_to_dodge_a_circle() -> None:
    inside = [
        f"{name_of(path)}:{fn.name}"
        for path, tree in sources()
        for fn in ast.walk(tree)
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef)
        for node in ast.walk(fn)
        if isinstance(node, ast.ImportFrom) and node.level > 0 and node.lineno not in optional_imports(tree)
    ]
    assert inside == []


def test_no_module_reads_another_object_s_private_attributes() -> None:
    reads = set()
    for path, tree in sources():
        imported = {
            alias.asname or alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import | ast.ImportFrom)
            for alias in node.names
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and re.fullmatch(r"_[A-Za-z]\w*", node.attr)):
                continue
            base = node.value
            while isinstance(base, ast.Attribute | ast.Call | ast.Subscript):
                base = base.value if not isinstance(base, ast.Call) else base.func
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Name) and base.id in imported and base.id not in ("astage",):
                continue  # a module's attribute (torch._C, gc, ...)
            if node.attr in FOREIGN_PRIVATE:
                continue
            reads.add(f"{name_of(path)}: {ast.unparse(node)}")
    assert reads == set()


def test_no_private_name_is_imported_from_another_room() -> None:
    imports = [
        f"{name_of(path)}: {alias.name} from {'.' * node.level}{node.module}"
        for path, tree in sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.level >= 2 and node.module
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]
    assert imports == []


def test_the_code_cites_no_issue_numbers() -> None:
    cited = [
        f"{name_of(path)}:{n}"
        for path, _ in sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bissues? #?\d+", line, re.IGNORECASE)
    ]
    assert cited == []


@pytest.mark.parametrize("call", ["freeze", "unfreeze", "collect", "set_threshold"])
def test_the_library_never_ages_collects_or_retunes_the_program_s_heap(call: str) -> None:
    uses = [
        f"{name_of(path)}:{node.lineno}"
        for path, tree in sources()
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and node.attr == call
        and isinstance(node.value, ast.Name)
        and node.value.id == "gc"
    ]
    assert uses == []


def test_the_public_surface_is_small() -> None:
    assert len(astage.__all__) <= 32
