"""The post-import mechanism of verl_ext.patching on throw-away modules (no verl involved)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from verl_ext import patching as seam

MODULE_SOURCE = """
def greet(name):
    return "hello " + name

class Greeter:
    def hello(self):
        return "hello"

    @staticmethod
    def static():
        return "static"

    @classmethod
    def klass(cls):
        return cls.__name__
"""


@pytest.fixture
def fresh_module(tmp_path, monkeypatch):
    """A new importable module name (and one that imports a name from it) per test."""
    name = f"seam_target_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE_SOURCE))
    (tmp_path / f"{name}_user.py").write_text(f"from {name} import greet\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    saved = dict(seam._registry.states), {k: list(v) for k, v in seam._registry.callbacks.items()}
    yield name
    for module in (name, f"{name}_user"):
        sys.modules.pop(module, None)
    seam._registry.states.clear()
    seam._registry.states.update(saved[0])
    seam._registry.callbacks.clear()
    seam._registry.callbacks.update(saved[1])


def patch(module: str, target: str, wrap, versions: str = ">=0") -> seam.Touch:
    return seam.Touch("patch", module, target, "plugin", why="test", versions=versions, code=wrap)


def shout(original):
    return lambda *args, **kwargs: original(*args, **kwargs).upper()


def test_patch_applies_when_module_is_first_imported_and_before_names_are_bound(fresh_module):
    seam.install([patch(fresh_module, "greet", shout)])
    assert fresh_module not in sys.modules
    user = importlib.import_module(f"{fresh_module}_user")  # binds `greet` at import time
    assert user.greet("you") == "HELLO YOU"
    assert getattr(sys.modules[fresh_module].greet, seam.ORIGINAL_ATTR)("x") == "hello x"


def test_patch_applies_at_once_when_module_already_imported(fresh_module):
    module = importlib.import_module(fresh_module)
    seam.install([patch(fresh_module, "greet", shout)])
    assert module.greet("a") == "HELLO A"


def test_methods_static_and_class_methods_keep_their_kind(fresh_module):
    seam.install(
        [
            patch(fresh_module, "Greeter.hello", shout),
            patch(fresh_module, "Greeter.static", shout),
            patch(fresh_module, "Greeter.klass", shout),
        ]
    )
    greeter = importlib.import_module(fresh_module).Greeter
    assert greeter().hello() == "HELLO"
    assert greeter.static() == "STATIC" and greeter().static() == "STATIC"
    assert greeter.klass() == "GREETER"


def test_installing_twice_wraps_once(fresh_module):
    exclaim = patch(fresh_module, "greet", lambda orig: (lambda n: orig(n) + "!"))
    seam.install([exclaim])
    seam.install([exclaim])
    assert importlib.import_module(fresh_module).greet("x") == "hello x!"


def test_missing_target_is_recorded_and_logged_not_raised(fresh_module, caplog):
    seam.install([patch(fresh_module, "nothing_here", shout)])
    importlib.import_module(fresh_module)  # the user's import still works
    state = next(s for s in seam.states() if s.touch.target == "nothing_here")
    assert not state.applied and "nothing_here" in state.error
    assert "could not apply patch" in caplog.text


def test_when_imported_runs_callbacks_once(fresh_module):
    calls = []
    seam.when_imported(fresh_module, lambda module: calls.append(module.__name__))
    importlib.import_module(fresh_module)
    importlib.import_module(fresh_module)
    assert calls == [fresh_module]


def test_a_touch_outside_its_verl_range_is_not_applied(fresh_module):
    """Issue 18: Touch.versions gates what is applied; the state says why a touch was left out."""
    installed = seam.installed_verl()
    assert installed is not None
    seam.install([patch(fresh_module, "greet", shout, versions=f"!={installed}")])
    module = importlib.import_module(fresh_module)
    assert module.greet("you") == "hello you"  # not patched
    state = next(s for s in seam.states() if s.touch.name == f"{fresh_module}.greet")
    assert not state.applied and state.error is None
    assert state.skipped == f"not applied: verl {installed} is outside its range !={installed}"


def test_a_touch_inside_its_verl_range_is_applied(fresh_module):
    installed = seam.installed_verl()
    seam.install([patch(fresh_module, "greet", shout, versions=f"=={installed}")])
    assert importlib.import_module(fresh_module).greet("you") == "HELLO YOU"


def test_a_touch_without_a_version_specifier_is_refused():
    with pytest.raises(ValueError, match="PEP 440 specifier such as '==0.9.1', got '0.6.1 - 0.9.1'"):
        seam.Touch("patch", "m", "t", "plugin", why="test", versions="0.6.1 - 0.9.1", code=shout)
