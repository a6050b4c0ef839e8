"""The package's structure: imports without side effects, layers that import only downwards, one
index of every touch of verl, and a wheel (configs/ included) that builds without setuptools' warnings."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl_ext"

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
    # the in-process runner and its vLLM replica need the backend active before they import verl, and say so instead
    assert [name for name, _ in report["refused"]] == ["verl_ext.cpu.in_process", "verl_ext.cpu.vllm_replica"]
    assert all("verl_ext.cpu.activate()" in why for _, why in report["refused"])


# Each package may import the ones listed for it, and the ground floor (the modules directly under
# verl_ext/: estimators, kernels, registry, options, patching, touches, errors); the ground floor
# imports only itself. verl_ext.cli is the top. Imports inside functions count as well.
ALLOWED = {
    "trace": set(),
    "steps": {"trace"},  # the model of a traced step, which the checker, the inspection and the view share
    "check": {"trace", "steps"},  # the checker reads a trace; it never imports the analysis (inspect) above it
    "inspect": {"trace", "steps", "check"},  # the analysis shows and renders what the checker finds
    "integration": {"trace"},  # plugin.py activates the CPU backend only when its switch is set
    "view": {"trace", "steps", "check", "inspect"},  # the browser view shows what the checker and the inspection compute
    "cpu": set(),  # the backend knows verl, not the tasks nor the apps that run on it
    "tasks": {"cpu"},  # a task's assets feed a CPU run; it never reads traces nor imports check or inspect
    # they call the checker and the inspection directly, never the CLI; they check a run's config as its driver will (integration)
    "apps": {"trace", "steps", "check", "inspect", "view", "cpu", "tasks", "integration"},
}
#: Activation, behind its switches: VERL_USE_EXTERNAL_MODULES=verl_ext, VERL_EXT_CPU=1.
ACTIVATION = {
    ("verl_ext", "verl_ext.integration.plugin"),
    ("verl_ext", "verl_ext.integration.plugin.activate_loudly"),
    ("verl_ext.integration.plugin", "verl_ext.cpu"),
}
MODULES = {
    ".".join(("verl_ext", *path.relative_to(PACKAGE).with_suffix("").parts)).removesuffix(".__init__"): path
    for path in sorted(PACKAGE.rglob("*.py"))
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "verl_ext" or len(parts) == 1:
        return "verl_ext"
    return parts[1] if parts[1] in ALLOWED or parts[1] == "cli" else "ground"


def imported_modules(path: Path) -> set[str]:
    """Every verl_ext name ``path`` imports, at module level or inside a function: ``from a import b``
    gives ``a`` and ``a.b`` (``b`` may be a module or a name in ``a``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("verl_ext")}


@pytest.mark.parametrize("module", sorted(MODULES), ids=lambda m: str(MODULES[m].relative_to(PACKAGE)))
def test_lower_layers_never_import_upper_ones(module):
    own = layer(module)
    if own == "cli":
        return
    allowed = {"ground", "verl_ext", own} | ALLOWED.get(own, set())
    imports = {name for name in imported_modules(MODULES[module]) if (module, name) not in ACTIVATION}
    wrong = sorted(name for name in imports if layer(name) not in allowed)
    assert wrong == [], f"{module} ({own}) imports {wrong}"


def module_graph() -> dict[str, set[str]]:
    """module -> the verl_ext modules it imports (lazy imports included, activation edges left out)."""
    graph = {}
    for module, path in MODULES.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from a import b``: the module a.b when there is one, else the module a
                targets |= {f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in MODULES else node.module for alias in node.names}
        activation = {target for source, target in ACTIVATION if source == module}
        graph[module] = {name for name in targets if name in MODULES and name != module} - activation
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_even_through_lazy_imports():
    """Lazy imports defer verl, torch and matplotlib; they never hide a cycle between verl-ext's modules."""
    assert cycles(module_graph()) == []


def test_every_touch_of_verl_is_one_record_with_why_and_versions():
    from verl_ext import patching
    from verl_ext.touches import CPU_TOUCHES, PLUGIN_TOUCHES, TOUCHES

    assert TOUCHES == PLUGIN_TOUCHES + CPU_TOUCHES
    assert len({touch.name for touch in TOUCHES}) == len(TOUCHES)
    for touch in TOUCHES:
        # verl's code; or, under the CPU backend, vLLM's CPU build's code, and the package metadata verl reads
        # (its vLLM rollout asks importlib.metadata for the distribution "vllm")
        touched = touch.module.startswith("verl.") or (touch.component == "cpu" and touch.module.startswith(("vllm.", "importlib.metadata")))
        assert touch.kind in patching.KINDS and touched and len(touch.why) > 40
        assert touch.versions and touch.component in ("plugin", "cpu")
    # every wrapper and registration the package defines is named by a record
    named = {touch.code for touch in TOUCHES}
    for module, prefixes in (("integration/patches.py", ("wrap_", "register_")), ("cpu/patches.py", ("", ))):
        tree = ast.parse((PACKAGE / module).read_text())
        defined = {f"verl_ext.{module[:-3].replace('/', '.')}:{node.name}" for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
        defined = {name for name in defined if name.split(":")[1].startswith(prefixes)}
        assert defined <= named, sorted(defined - named)


def test_building_the_package_warns_about_nothing_it_leaves_out(tmp_path):
    """The package (configs/ included) builds without setuptools' 'Package would be ignored'."""
    source = tmp_path / "src"
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), str(source)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "would be ignored" not in result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheel").glob("verl_ext-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "verl_ext/configs/verl_ext_trainer.yaml" in names and not any("__pycache__" in n for n in names)
