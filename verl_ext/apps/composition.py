"""A run's config composed and checked before anything starts: the commands that start trainers
(``verl-ext demo``, ``selftest``, ``recipes/cpu_demo.sh`` through :mod:`verl_ext.apps.overrides`) and
``verl-ext replay`` fail here, in seconds and in one line, on a key verl's config does not have
(with the nearest keys it does have), on a value verl-ext's own options refuse, on a value of the
wrong type for verl's typed config (its dataclasses), or on what verl's own ``validate_config``
refuses, instead of after Ray, the trainer or the workers started.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import importlib
import os
import re
import types
import typing
import warnings
from typing import TYPE_CHECKING, Any

from verl_ext.errors import UsageError

if TYPE_CHECKING:
    from omegaconf import DictConfig

_UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'")


def checked_config(
    overrides: list[str], config_dir: str | os.PathLike | None = None, config_name: str = "ppo_trainer", verl_validates: bool = True
) -> "DictConfig":
    """The config ``python -m verl.trainer.main_ppo`` composes from ``overrides`` (verl's own
    ``ppo_trainer``, or ``config_name`` in ``config_dir``), checked as the run's driver checks it:
    verl-ext's options (:func:`verl_ext.integration.validation.check_config`), then the types of verl's
    typed config (:func:`check_types`) and verl's own ``validate_config`` (``verl_validates=False``: not it,
    for an entry point that does not call it, verl's fully-async trainer). UsageError, one line: a key
    the config does not have (naming the nearest it has), a value verl-ext refuses, a value of the wrong
    type (naming the key and the value), or what verl's validation says."""
    from verl_ext.cpu.overrides import compose_config
    from verl_ext.integration.validation import check_config

    try:
        config = compose_config(overrides, config_dir, config_name)
    except Exception as error:  # noqa: BLE001 - hydra's and omegaconf's errors alike
        unknown = _UNKNOWN_KEY.search(str(error))
        if unknown is None:
            raise UsageError(f"verl's config does not compose: {_first_line(error)}") from None
        raise UsageError(unknown_key_message(unknown.group(1), overrides, config_dir, config_name)) from None
    try:
        check_config(config)
    except ValueError as error:
        # the commands print a UsageError after their own prefix ("verl-ext: ", "verl-ext selftest: "); a
        # message written for a run's traceback may carry verl-ext's: one prefix, not two
        raise UsageError(str(error).removeprefix("verl-ext: ")) from None
    check_types(config)
    if verl_validates:
        verl_validation(config)
    return config


def verl_validation(config: "DictConfig") -> None:
    """verl's own ``validate_config`` on ``config``, as ``main_ppo`` runs it before Ray starts (its
    ``print`` kept off the caller's stdout, which a shell may be reading: :mod:`verl_ext.apps.overrides`);
    UsageError with what it says, in one line. Call :func:`check_types` first: verl's dataclasses take a
    value of the wrong type without a word, and fail later on it."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    from verl_ext.integration.validation import critic_required

    validate = getattr(validate_config, "__wrapped__", validate_config)  # the plugin's wrapper adds check_config
    try:
        # what it prints and warns (e.g. "Disabled critic ...") the run says again, in its own log
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            use_critic = critic_required(config) or need_critic(config)
            validate(config, use_reference_policy=need_reference_policy(config), use_critic=use_critic)
    except Exception as error:  # noqa: BLE001 - verl's asserts, ValueErrors and hydra's instantiation errors alike
        raise UsageError(f"verl's validate_config refuses the config: {_verl_says(error)}") from None


def _verl_says(error: BaseException) -> str:
    """One line of what verl's validation raised: hydra's instantiation error as the node and its cause
    (``actor_rollout_ref.actor: Invalid loss_agg_mode: foo``), else the message's first line."""
    node = re.search(r"full_key: (\S+)", str(error))
    cause = error.__cause__
    if cause is not None and node is not None:
        return f"{node.group(1)}: {_first_line(cause)}"
    return _first_line(error) if str(error).strip() else type(error).__name__


# --------------------------------------------------------------------------- verl's typed config

#: The value types of a dataclass field that the check compares a value with (Optional of them too).
_VALUE_TYPES = (bool, int, float, str)


def check_types(config: "DictConfig", keys: typing.Iterable[str] | None = None) -> None:
    """Every value of ``config`` that a node of verl's typed config declares (a node whose ``_target_``
    is one of verl's dataclasses: the actor, rollout, critic, algorithm, optimizers, ...) converted to
    the field's type as OmegaConf converts a value for a typed config: ``ppo_epochs=abc`` or ``=1.5``, a
    word for a float, ``abc`` for a bool. verl instantiates these dataclasses without converting, so
    such a value passes its validation and fails later, in the workers. Interpolations and missing
    values are left to verl. ``keys``: check these dotted keys only (a replay's overrides). UsageError,
    one line naming the key and the value, and the dataclass."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    wanted = None if keys is None else set(keys)
    for path, node, cls in _typed_nodes(config, ""):
        schema = _schema(cls)
        if schema is None:
            continue
        typed = OmegaConf.structured(schema)
        for name in typed.keys():
            key = f"{path}.{name}" if path else str(name)
            if (wanted is not None and key not in wanted) or name not in node:
                continue
            if OmegaConf.is_missing(node, name) or OmegaConf.is_interpolation(node, name):
                continue
            value = node[name]
            try:
                typed[name] = value
            except OmegaConfBaseException as error:
                raise UsageError(f"{key}={value}: {_first_line(error)} (verl's {cls.__name__})") from None


def _typed_nodes(node: Any, path: str):
    """(dotted path, node, its dataclass) of every node under ``node`` whose ``_target_`` is a dataclass."""
    from omegaconf import DictConfig, OmegaConf

    cls = _dataclass_of(node.get("_target_"))
    if cls is not None:
        yield path, node, cls
    for name in node.keys():
        if OmegaConf.is_missing(node, name) or OmegaConf.is_interpolation(node, name):
            continue
        child = node[name]
        if isinstance(child, DictConfig):
            yield from _typed_nodes(child, f"{path}.{name}" if path else str(name))


@functools.lru_cache(maxsize=None)
def _dataclass_of(target: Any) -> type | None:
    if not isinstance(target, str) or "." not in target:
        return None
    module, _, name = target.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - not importable here: verl says so when it instantiates it
        return None
    return cls if dataclasses.is_dataclass(cls) else None


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> type | None:
    """A dataclass of ``cls``'s fields whose type is a value type (:data:`_VALUE_TYPES`, an Enum, or
    Optional of one), all missing: OmegaConf converts what is assigned to each as it would for ``cls``.
    (``OmegaConf.structured(cls)`` itself fails on some of verl's classes, whose defaults do not match
    their declared types.) None when it has none."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: nothing to compare with
        return None
    from omegaconf import MISSING

    fields = [(f.name, _value_type(hints.get(f.name))) for f in dataclasses.fields(cls) if not f.name.startswith("_")]
    fields = [(name, kind, dataclasses.field(default=MISSING)) for name, kind in fields if kind is not None]
    return dataclasses.make_dataclass(f"Typed{cls.__name__}", fields) if fields else None


def _value_type(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        kind = _value_type(inner[0]) if len(inner) == 1 else None
        return None if kind is None else typing.Optional[kind]
    if annotation in _VALUE_TYPES or (isinstance(annotation, type) and issubclass(annotation, enum.Enum)):
        return annotation
    return None


def unknown_key_message(key: str, overrides: list[str], config_dir, config_name: str) -> str:
    """One line for an override of ``key``, which the config does not have: the nearest keys it has."""
    nearest = nearest_keys(key, overrides, config_dir, config_name)
    hint = f"did you mean {' or '.join(nearest)}?" if nearest else "no key of that node is close"
    return f"{key} is not a key of the trainer's config: {hint} (a new key is added with +{key}=…)"


def nearest_keys(key: str, overrides: list[str], config_dir, config_name: str, count: int = 3) -> list[str]:
    """Up to ``count`` keys beside ``key`` (under the same parent) whose names are closest to its own."""
    from omegaconf import DictConfig, OmegaConf

    from verl_ext.cpu.overrides import compose_config, override_key

    parent, _, name = key.rpartition(".")
    try:
        config = compose_config([o for o in overrides if override_key(o) != key], config_dir, config_name)
    except Exception:  # noqa: BLE001 - another override fails too: no suggestion
        return []
    node = OmegaConf.select(config, parent) if parent else config
    if not isinstance(node, DictConfig):
        return []
    siblings = [str(sibling) for sibling in node.keys()]
    return [f"{parent}.{match}" if parent else match for match in difflib.get_close_matches(name, siblings, n=count, cutoff=0.6)]


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
