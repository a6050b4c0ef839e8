"""Hydra's YAML files read once, and each of its compositions made once, per test process.

The tests compose verl's trainer config about 230 times a suite (in the pytest-xdist workers), about
60 of them a composition made before in the same process. Each composition parsed the same ~27 YAML
files again (about 0.5 s of a 0.6 s composition, some 75 s of CPU a suite), and still takes about
0.18 s to merge them. :func:`install` keeps

* each file's parsed config, keyed by the file's path, modification time and size;
* each composition Hydra made without a warning, keyed by what it was asked (the config's name, the
  overrides, the search path) and by what else it reads (the working directory, the version base, the
  job's name, the variables of ``hydra.job.env_copy``), for as long as no file or directory under
  the config sources it read changed (path, modification time and size of each);

and gives every use its own copy, unpickled (a tenth of a deep copy's time: Hydra edits what it loads,
and a test what it gets). The composed configs are those Hydra composes without it
(tests/test_config_cache.py). Only the test processes install it: verl-ext itself, its trainer runs
and their children compose as Hydra does.

Supports hydra-core 1.3 (its registry of config sources and its config loader are private:
:func:`install` fails to import when they move)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import warnings
from typing import NamedTuple


def install() -> None:
    """Wrap ``load_config`` of Hydra's file and package-resource config sources, and its config
    loader's ``load_configuration`` (once).

    The classes are those Hydra's plugin scan registered: the scan loads its modules afresh, so the
    classes a plain import gives are not the ones it uses."""
    from importlib import resources

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the scan, which registers the config sources
    files, packages = SourcesRegistry.instance().resolve("file"), SourcesRegistry.instance().resolve("pkg")
    if getattr(files.load_config, "cached", False):
        return
    files.load_config = _cached(files.load_config, lambda source, name: os.path.join(source.path, name))
    packages.load_config = _cached(packages.load_config, lambda source, name: str(resources.files(source.path).joinpath(name)))
    ConfigLoaderImpl.load_configuration = _composed_once(ConfigLoaderImpl.load_configuration)


def _cached(load, locate):
    parsed = {}

    def load_config(source, config_path: str):
        path = os.path.realpath(locate(source, source._normalize_file_name(config_path)))
        try:
            stat = os.stat(path)
        except OSError:  # not a plain file: Hydra reads it (and says what is wrong)
            return load(source, config_path)
        key = (path, stat.st_mtime_ns, stat.st_size)
        if key not in parsed:
            result = load(source, config_path)
            parsed[key] = (result, pickle.dumps(result.config))
        result, config = parsed[key]
        return dataclasses.replace(result, config=pickle.loads(config), header=dict(result.header))

    load_config.cached = True
    return load_config


class _Kept(NamedTuple):
    config: bytes  # pickled
    variables: tuple[str, ...]  # its hydra.job.env_copy
    roots: tuple[str, ...]  # the directories of its config sources
    state: tuple  # _state(variables, roots) when it was composed


def _composed_once(load_configuration):
    composed: dict[tuple, _Kept] = {}

    def load(self, config_name, overrides, run_mode, from_shell=True, validate_sweep_overrides=True):
        from hydra import version
        from hydra.core.utils import JobRuntime

        asked = (config_name, overrides, run_mode, from_shell, validate_sweep_overrides)
        key = (
            config_name, tuple(overrides), run_mode, from_shell, validate_sweep_overrides,
            tuple((element.provider, element.path) for element in self.config_search_path.get_path()),
            os.getcwd(), version.getbase(), JobRuntime.instance().get("name"),
        )  # fmt: skip
        kept = composed.get(key)
        if kept is not None and kept.state == _state(kept.variables, kept.roots):
            return pickle.loads(kept.config)
        try:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                config = load_configuration(self, *asked)
        except Exception:
            if not said:
                raise
        if said:  # composed again as Hydra composes, to say its warnings (and its error) as it says them; not kept
            return load_configuration(self, *asked)
        roots = _roots(config.hydra.runtime.config_sources)
        if roots is not None:
            variables = tuple(config.hydra.job.env_copy)
            composed[key] = _Kept(pickle.dumps(config), variables, roots, _state(variables, roots))
        return config

    return load


def _state(variables: tuple[str, ...], roots: tuple[str, ...]) -> tuple:
    """What a composition read besides what it was asked: the variables' values, the trees of its sources."""
    return tuple(os.environ.get(name) for name in variables), _trees(roots)


def _roots(sources) -> tuple[str, ...] | None:
    """The directories of a composition's file and package config sources; None where one is not a
    directory (a package in a zip file)."""
    from importlib import resources
    from pathlib import Path

    roots = []
    for source in sources:
        if source.schema == "file":
            roots.append(os.path.abspath(source.path))
        elif source.schema == "pkg":
            try:
                root = resources.files(source.path)
            except (ImportError, TypeError):
                return None
            if not isinstance(root, Path):
                return None
            roots.append(str(root))
    return tuple(roots)


def _trees(roots: tuple[str, ...]) -> tuple:
    """(path, modification time, size) of every file and directory under each of ``roots``."""
    entries = []
    pending = list(roots)
    while pending:
        directory = pending.pop()
        try:
            with os.scandir(directory) as scan:
                for entry in scan:
                    if entry.name == "__pycache__":
                        continue
                    stat = entry.stat()
                    entries.append((entry.path, stat.st_mtime_ns, stat.st_size))
                    if entry.is_dir():
                        pending.append(entry.path)
        except OSError:
            entries.append((directory, None, None))
    return tuple(sorted(entries))
