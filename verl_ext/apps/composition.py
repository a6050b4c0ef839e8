"""A run's config composed and checked before anything starts: the commands that start trainers
(``verl-ext selftest``, ``recipes/cpu_demo.sh`` through :mod:`verl_ext.apps.overrides`) fail here,
in seconds and in one line, on a key verl's config does not have (with the nearest keys it does
have) or on a value verl-ext's own options refuse, instead of after Ray and the trainer started.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import TYPE_CHECKING

from verl_ext.errors import UsageError

if TYPE_CHECKING:
    from omegaconf import DictConfig

_UNKNOWN_KEY = re.compile(r"Could not override '([^']+)'")


def checked_config(overrides: list[str], config_dir: str | os.PathLike | None = None, config_name: str = "ppo_trainer") -> "DictConfig":
    """The config ``python -m verl.trainer.main_ppo`` composes from ``overrides`` (verl's own
    ``ppo_trainer``, or ``config_name`` in ``config_dir``), with verl-ext's options checked as its
    driver checks them (:func:`verl_ext.integration.validation.check_config`). UsageError, one line:
    a key the config does not have (naming the nearest it has), or a value verl-ext refuses."""
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
    return config


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
