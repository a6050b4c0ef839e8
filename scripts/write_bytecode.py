"""Writes the bytecode of what verl-ext's runs, commands and tests import, once, at set-up (the Makefile).

    python scripts/write_bytecode.py libraries   # needs no vLLM: runs while pip installs vLLM's CPU build
    python scripts/write_bytecode.py verl        # verl's trainer, verl-ext, and vLLM's server modules

pip installs without compiling: compiling every installed file took 52 s of the set-up, most of it for
modules nothing imports. Without bytecode, the first processes that import a module each compile it
side by side (at a suite's start, its controller, its workers and the fork server all import torch;
then each Ray worker of the first run compiles verl): a fresh clone's pytest took 478 s, and 367 s
once the bytecode was there. Importing writes the bytecode of exactly what is imported, once.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings

PARTS = {
    "libraries": (
        "numpy", "torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint", "transformers",
        "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "datasets", "pandas", "pyarrow",
        "polars", "hydra", "omegaconf", "peft", "fastapi", "uvicorn", "aiohttp", "requests", "zmq", "duckdb",
        "matplotlib.pyplot", "ray", "tensordict", "pytest", "hypothesis",
    ),
    # under the CPU backend: verl imports its vLLM modules only where it finds vLLM's version
    "verl": (
        "verl.trainer.main_ppo", "verl.trainer.ppo.ray_trainer", "verl.workers.engine_workers",
        "verl.workers.engine.fsdp.transformer_impl",
        "verl.experimental.agent_loop", "verl.workers.rollout.vllm_rollout.vllm_async_server", "verl_ext.cli",
        "verl_ext.cpu.in_process", "verl_ext.cpu.vllm_rollout", "verl_ext.view.server",
    ),
}  # fmt: skip


def main(part: str) -> int:
    if part not in PARTS:
        print(f"write_bytecode.py: no part {part!r} (one of: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    if sys.flags.dont_write_bytecode:
        print("write_bytecode.py: PYTHONDONTWRITEBYTECODE is set; run it with that variable unset", file=sys.stderr)
        return 2
    # what the imports say (optional backends missing) is no news here
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARN")
    warnings.filterwarnings("ignore", message=r".* engine is not available")  # verl's optional engines
    if part == "verl":
        os.environ["VERL_EXT_CPU"] = "1"
    started = time.perf_counter()
    for name in PARTS[part]:
        importlib.import_module(name)
    print(f"bytecode written for {part} ({len(sys.modules)} modules imported) in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:2]) if len(sys.argv) == 2 else main(""))
