"""Every monkeypatch verl-ext applies to verl, and the one mechanism that applies them.

Why patches at all: verl (0.6.1 … 0.9.1) never passes ``values`` to a registered advantage
estimator, switches the critic on only for ``gae``, never validates ``algorithm.adv_estimator``
before step 1, and offers no per-token hook. Those gaps cannot be closed through verl's public
registries, so verl-ext wraps a handful of verl functions. This file is where a reader finds
all of them:

* the plugin's patches (estimators, critic rule, validation, trace): ``PLUGIN_PATCHES`` in
  :mod:`verl_ext.integration.patches`;
* the CPU backend's patches (only with ``VERL_EXT_CPU=1``): ``CPU_PATCHES`` in
  :mod:`verl_ext.cpu.patches`.

Both lists are made of :class:`Patch` records that say what is wrapped, why, and for which verl
versions; ``verl-ext doctor`` prints them with their state.

How: patches are applied lazily by a post-import hook. A patch on ``verl.trainer.ppo.ray_trainer``
is applied the moment that module finishes executing, *before* any other module can run
``from verl.trainer.ppo.ray_trainer import compute_advantage``. That is what makes the patch
visible to modules that bind names at import time (verl 0.9's V1 trainer, verl 0.8's
``main_ppo_sync``, third-party recipes), and it keeps ``import verl`` as fast as without the
plugin because nothing heavy is imported early. If a target module is already imported when
:func:`install` runs, the patch is applied at once (names bound before that moment keep the original; verl loads its
plugins before any of its submodules, so this happens only to a plugin imported late by hand).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

logger = logging.getLogger("verl_ext")

#: Attribute set on every replacement, pointing at what it replaced (a second load wraps nothing).
ORIGINAL_ATTR = "__verl_ext_original__"


@dataclass(frozen=True)
class Patch:
    """One wrapped verl function: ``module.target = wrap(module.target)``.

    ``target`` is dotted inside the module ("compute_advantage" or "RayPPOTrainer.fit").
    ``wrap`` receives the original callable and returns the replacement.
    """

    module: str
    target: str
    wrap: Callable[[Any], Any]
    why: str
    versions: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.target}"


@dataclass
class PatchState:
    patch: Patch
    applied: bool = False
    error: str | None = None
    skipped_reason: str | None = None


@dataclass
class _Registry:
    callbacks: dict[str, list[Callable[[Any], None]]] = field(default_factory=dict)
    states: dict[str, PatchState] = field(default_factory=dict)
    lock: threading.RLock = field(default_factory=threading.RLock)


_registry = _Registry()


def when_imported(module_name: str, callback: Callable[[Any], None]) -> None:
    """Run ``callback(module)`` now if ``module_name`` is imported, else right after its first import."""
    with _registry.lock:
        module = sys.modules.get(module_name)
        if module is not None and not _is_initialising(module):
            callback(module)
            return
        _registry.callbacks.setdefault(module_name, []).append(callback)
        _ensure_finder()


def install(patches: Iterable[Patch]) -> None:
    """Apply each patch as soon as its module is imported (at once if it already is)."""
    for patch in patches:
        with _registry.lock:
            if patch.name in _registry.states:
                continue  # idempotent: a plugin imported twice must not wrap twice
            _registry.states[patch.name] = PatchState(patch)
        when_imported(patch.module, lambda module, p=patch: _apply(p, module))


def states() -> list[PatchState]:
    """The state of every patch installed in this process, in installation order."""
    with _registry.lock:
        return list(_registry.states.values())


def _apply(patch: Patch, module: Any) -> None:
    state = _registry.states[patch.name]
    try:
        owner, attr = _resolve_owner(module, patch.target)
        # Read from __dict__ for classes so staticmethod/classmethod descriptors survive the wrap.
        original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
        if getattr(_unwrap_descriptor(original), ORIGINAL_ATTR, None) is not None:
            state.applied = True  # already wrapped by an earlier load of this plugin
            return
        replacement = _rewrap_descriptor(original, patch.wrap)
        setattr(_unwrap_descriptor(replacement), ORIGINAL_ATTR, _unwrap_descriptor(original))
        setattr(owner, attr, replacement)
        state.applied = True
    except Exception as exc:  # a patch that cannot apply must be loud, never silent
        state.error = f"{type(exc).__name__}: {exc}"
        logger.error("verl-ext could not patch %s (%s); run `verl-ext doctor`", patch.name, state.error)


def _resolve_owner(module: Any, target: str) -> tuple[Any, str]:
    *path, attr = target.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    if not (attr in getattr(owner, "__dict__", {}) or hasattr(owner, attr)):
        raise AttributeError(f"{module.__name__} has no attribute {target!r}")
    return owner, attr


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
