"""The package's structure: imports without side effects, layers that import only downwards, and one
index of every touch of verl."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verl_ext"

IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
before = list(sys.meta_path)
import verl_ext
refused = []
for info in pkgutil.walk_packages(verl_ext.__path__, "verl_ext."):
    try:
        importlib.import_module(info.name)
    except ImportError as error:
        refused.append([info.name, str(error)])
from verl_ext import patching
from verl_ext.integration import plugin
cpu = sys.modules.get("verl_ext.cpu")
print(json.dumps({
    "meta_path_changed": sys.meta_path != before,
    "touches_installed": [state.touch.name for state in patching.states()],
    "plugin_loaded": plugin.LOADED,
    "cpu_active": bool(cpu and cpu.is_active()),
    "refused": refused,
}))
"""


def test_importing_every_module_activates_nothing():
    """With verl's own plugin loading switched off, importing all of verl_ext installs no hook, applies
    no touch and activates neither the plugin nor the CPU backend (even with the CPU switch set)."""
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none", "VERL_USE_EXTERNAL_MODULES": "", "VERL_EXT_CPU": "1"}
    result = subprocess.run([sys.executable, "-c", IMPORT_EVERYTHING], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["meta_path_changed"] is False and report["touches_installed"] == []
    assert report["plugin_loaded"] is False and report["cpu_active"] is False
    # the in-process runner needs the backend active before it imports verl, and says so instead
    assert [name for name, _ in report["refused"]] == ["verl_ext.cpu.in_process"]
    assert "verl_ext.cpu.activate()" in report["refused"][0][1]


# Each package may import the ones listed for it, and the ground floor (the modules directly under
# verl_ext/: estimators, kernels, registry, options, patching, touches, errors); the ground floor
# imports only itself. verl_ext.cli is the top.
ALLOWED = {
    "trace": set(),
    "inspect": {"trace"},
    "integration": {"trace"},  # plugin.py activates the CPU backend only when its switch is set
    "view": {"trace", "inspect"},  # the browser view shows what the inspection computes
    "cpu": {"trace", "inspect", "view", "cli"},  # the demo prints what the inspection commands print, and writes the page
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "verl_ext" or len(parts) == 1:
        return "verl_ext"
    return parts[1] if parts[1] in ALLOWED or parts[1] == "cli" else "ground"


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("verl_ext")}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_lower_layers_never_import_upper_ones(path):
    module = ".".join(("verl_ext", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")
    own = layer(module)
    if own == "cli":
        return
    allowed = {"ground", "verl_ext", own} | ALLOWED.get(own, set())
    exceptions = {  # activation, behind its switches: VERL_USE_EXTERNAL_MODULES=verl_ext, VERL_EXT_CPU=1
        ("verl_ext", "verl_ext.integration.plugin"),
        ("verl_ext", "verl_ext.integration.plugin.activate_loudly"),
        ("verl_ext.integration.plugin", "verl_ext.cpu"),
    }
    imports = {name for name in imported_modules(path) if (module, name) not in exceptions}
    wrong = sorted(name for name in imports if layer(name) not in allowed)
    assert wrong == [], f"{module} ({own}) imports {wrong}"


def module_name(path: Path) -> str:
    return ".".join(("verl_ext", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> the verl_ext modules it imports anywhere, inside functions too; ``from package
    import module`` is an import of that module (the package's ``__init__`` runs first anyway)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for module, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
                imported |= submodules or {node.module}
        graph[module] = {name for name in imported if name in modules and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for other in sorted(graph[module]):
            if other not in index:
                visit(other)
                low[module] = min(low[module], low[other])
            elif other in stack:
                low[module] = min(low[module], index[other])
        if low[module] == index[module]:
            component = stack[stack.index(module):]
            del stack[stack.index(module):]
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


#: Cycles inside verl_ext/cpu/, which issue 16 item 4 splits into three packages; remove each entry
#: as that split breaks it.
CYCLES_OF_THE_CPU_SPLIT = [
    ["verl_ext.cli", "verl_ext.cpu.demo"],
    ["verl_ext.cpu.assets", "verl_ext.cpu.value_pretraining"],
]


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_even_through_imports_inside_functions():
    """A lazy import is for verl, torch and matplotlib, never to hide a cycle between our modules."""
    found = [cycle for cycle in cycles(import_graph()) if cycle not in CYCLES_OF_THE_CPU_SPLIT]
    assert found == []


def test_every_touch_of_verl_is_one_record_with_why_and_versions():
    from verl_ext import patching
    from verl_ext.touches import CPU_TOUCHES, PLUGIN_TOUCHES, TOUCHES

    assert TOUCHES == PLUGIN_TOUCHES + CPU_TOUCHES
    assert len({touch.name for touch in TOUCHES}) == len(TOUCHES)
    for touch in TOUCHES:
        assert touch.kind in patching.KINDS and touch.module.startswith("verl.") and len(touch.why) > 40
        assert touch.versions and touch.component in ("plugin", "cpu")
    # every wrapper and registration the package defines is named by a record
    named = {touch.code for touch in TOUCHES}
    for module, prefixes in (("integration/patches.py", ("wrap_", "register_")), ("cpu/patches.py", ("", ))):
        tree = ast.parse((PACKAGE / module).read_text())
        defined = {f"verl_ext.{module[:-3].replace('/', '.')}:{node.name}" for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
        defined = {name for name in defined if name.split(":")[1].startswith(prefixes)}
        assert defined <= named, sorted(defined - named)
