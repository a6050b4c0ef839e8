"""Hydra's YAML files read once per test process.

The tests compose verl's trainer config about 150 times (each with its own overrides, in the
pytest-xdist workers), and each composition parsed the same ~27 YAML files again: about 0.5 s of a
0.6 s composition, some 75 s of CPU a suite. :func:`install` keeps each file's parsed config, keyed
by the file's path, modification time and size, and gives every composition its own deep copy (Hydra
edits what it loads). The composed configs are those Hydra composes without it
(tests/test_config_cache.py). Only the test processes install it: verl-ext itself, its trainer runs
and their children compose as Hydra does.

Supports hydra-core 1.3 (its registry of config sources is private: :func:`install` fails to import
when it moves)."""

from __future__ import annotations

import copy
import dataclasses
import os


def install() -> None:
    """Wrap ``load_config`` of Hydra's file and package-resource config sources (once).

    The classes are those Hydra's plugin scan registered: the scan loads its modules afresh, so the
    classes a plain import gives are not the ones it uses."""
    from importlib import resources

    from hydra._internal.sources_registry import SourcesRegistry
    from hydra.core.plugins import Plugins

    Plugins.instance()  # the scan, which registers the config sources
    files, packages = SourcesRegistry.instance().resolve("file"), SourcesRegistry.instance().resolve("pkg")
    if getattr(files.load_config, "cached", False):
        return
    files.load_config = _cached(files.load_config, lambda source, name: os.path.join(source.path, name))
    packages.load_config = _cached(packages.load_config, lambda source, name: str(resources.files(source.path).joinpath(name)))


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
            parsed[key] = load(source, config_path)
        result = parsed[key]
        return dataclasses.replace(result, config=copy.deepcopy(result.config), header=dict(result.header))

    load_config.cached = True
    return load_config
