"""Writes the bytecode of what verl-ext's runs, commands and tests import, once, at set-up (the Makefile).

    python scripts/write_bytecode.py compile [--under torch] [--jobs N]   # the listed modules' bytecode
    python scripts/write_bytecode.py list                                # rewrite the list (import them)
    python scripts/write_bytecode.py list --add-written-after .venv/.verl-ext-setup   # and what a run compiled

pip installs without compiling: compiling every installed file took 52 s of the set-up, most of it for
modules nothing imports. Without bytecode, the first processes that import a module each compile it
side by side (at a suite's start, its controller, its workers and the fork server all import torch;
then each Ray worker of the first run compiles verl): a fresh clone's pytest took 478 s, and 367 s
once the bytecode was there.

What is compiled is :data:`LIST`: the files of the modules that importing :data:`MODULES` loads (about
6,800), relative to site-packages. ``list`` writes it by importing them (41 s on one core), ``compile``
compiles just those files without running them (11-12 s on two cores), in the same ``__pycache__`` files
an import writes. The list follows the pinned versions (constraints.txt, requirements/): rewrite it
when they change. A module it misses is compiled when first imported, as before; a file it names that
is not installed is skipped (tests/cpu/test_vllm_setup.py holds it to the installed set).

Importing :data:`MODULES` does not reach what is imported later and lazily (vLLM's server brings in 1,530
of openai's files, Ray's dashboard agent its modules, transformers a model's config by name): after a
fresh clone's ``make test``, ``list --add-written-after .venv/.verl-ext-setup`` adds every file whose
bytecode the run wrote after the set-up (a fresh clone's suite compiled 2,869 more files that way: its
pytest took 376 s, and 330 s with them in the list; calibrate 0.70-0.81 s), and keeps what the list holds
(the set-up compiled those before the run: without them, a second use dropped what the first had added).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import py_compile
import sys
import sysconfig
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

#: What the runs and tests import; under the CPU backend, where verl imports its vLLM modules.
MODULES = (
    "numpy", "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
    "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "datasets", "pandas", "pyarrow",
    "polars", "hydra", "omegaconf", "peft", "fastapi", "uvicorn", "aiohttp", "requests", "zmq", "duckdb",
    "matplotlib.pyplot", "ray", "tensordict", "pytest", "hypothesis",
    "verl.trainer.main_ppo", "verl.trainer.ppo.ray_trainer", "verl.workers.engine_workers",
    "verl.workers.engine.fsdp.transformer_impl", "verl.experimental.agent_loop",
    "verl.workers.rollout.vllm_rollout.vllm_async_server",
)  # fmt: skip
#: The files of the modules :data:`MODULES` load, relative to site-packages (``list`` writes it).
LIST = Path(__file__).with_name("bytecode_modules.txt")
ROOT = Path(__file__).resolve().parents[1]


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def write_list(written_after: Path | None = None) -> int:
    os.environ["VERL_EXT_CPU"] = "1"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARN")
    warnings.filterwarnings("ignore")
    for name in MODULES:
        importlib.import_module(name)
    site = site_packages()
    files = {
        Path(module.__file__).relative_to(site).as_posix()
        for module in list(sys.modules.values())
        if getattr(module, "__file__", None) and module.__file__.endswith(".py") and Path(module.__file__).is_relative_to(site)
    }
    if written_after is not None:
        # and what the list already holds: what an earlier run added was compiled by the set-up, before FILE
        files |= {name for name in LIST.read_text().split("\n") if name and (site / name).exists()}
        files |= compiled_since(site, written_after.stat().st_mtime)
    files = sorted(files)
    LIST.write_text("".join(f"{name}\n" for name in files))
    print(f"{LIST.name}: {len(files)} files")
    return 0


def compiled_since(site: Path, since: float) -> set[str]:
    """The files under ``site`` whose bytecode (this interpreter's) was written after ``since``."""
    tag = f".{sys.implementation.cache_tag}.pyc"
    return {
        source.relative_to(site).as_posix()
        for cached in site.rglob(f"__pycache__/*{tag}")
        if cached.stat().st_mtime > since and (source := cached.parent.parent / (cached.name[: -len(tag)] + ".py")).exists()
    }


def compile_files(paths: list[str]) -> int:
    """Compile each file as an import would (its ``__pycache__`` file, timestamp-checked), unless its
    bytecode is already newer; returns how many were compiled."""
    compiled = 0
    for path in paths:
        cached = importlib.util.cache_from_source(path)
        if os.path.exists(cached) and os.path.getmtime(cached) >= os.path.getmtime(path):
            continue
        try:
            py_compile.compile(path, doraise=True, invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
            compiled += 1
        except (py_compile.PyCompileError, OSError):  # a file that does not compile is not imported either
            pass
    return compiled


def compile_listed(under: str | None, jobs: int) -> int:
    site = site_packages()
    names = [name for name in LIST.read_text().split("\n") if name]
    paths = [str(site / name) for name in names if under is None or name.startswith(f"{under}/")]
    if under is None:  # verl-ext itself, which the editable install leaves in the checkout
        paths += [str(path) for path in sorted((ROOT / "verl_ext").rglob("*.py"))]
    paths = [path for path in paths if os.path.exists(path)]
    started = time.perf_counter()
    with ProcessPoolExecutor(jobs) as pool:
        compiled = sum(pool.map(compile_files, [paths[job::jobs] for job in range(jobs)]))
    print(f"bytecode written for {compiled} modules{f' under {under}/' if under else ''} in {time.perf_counter() - started:.0f} s")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="write_bytecode.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("compile", "list"))
    parser.add_argument("--under", help="compile only the listed files under this top-level package")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--add-written-after", type=Path, metavar="FILE",
                        help="list: also every file whose bytecode was written after FILE was (a run's, after the set-up), "
                             "and keep the files the list holds")
    args = parser.parse_args(argv)
    if sys.flags.dont_write_bytecode:
        print("write_bytecode.py: PYTHONDONTWRITEBYTECODE is set; run it with that variable unset", file=sys.stderr)
        return 2
    return write_list(args.add_written_after) if args.action == "list" else compile_listed(args.under, max(1, args.jobs))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
