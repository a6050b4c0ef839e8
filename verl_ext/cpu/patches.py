"""Every change the CPU backend makes to verl 0.9.1, in one list (see :mod:`verl_ext.integration.seam`).

Two kinds, both installed lazily (nothing here imports a heavy verl module):

* ``CPU_PATCHES``: verl functions wrapped because they hard-code a GPU assumption that no verl
  option can change. Each record says why and for which verl versions.
* ``CPU_REGISTRATIONS``: additions through verl's own registries (platform, engines, rollout,
  tokenizer family); nothing of verl's is replaced.

What is *not* here because verl's config already covers it (see :mod:`verl_ext.cpu.overrides`):
FSDP2 instead of FSDP1 (FSDP1 passes an integer ``device_id`` to ``FullyShardedDataParallel``),
``attn_implementation=sdpa`` and ``use_remove_padding=False`` (packed sequences need flash-attn),
no ``torch.compile``, fp32 instead of bf16 mixed precision, and logical GPUs for Ray
(``ray_init.num_gpus``; verl's ``ResourcePoolManager`` only counts Ray ``GPU`` resources).
"""

from __future__ import annotations

from typing import Any, Callable

from verl_ext.cpu import PLATFORM_NAME, ROLLOUT_NAME, SUPPORTED_VERL_VERSION
from verl_ext.integration.seam import Patch

VERL_VERSIONS = SUPPORTED_VERL_VERSION


def _gloo_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    return initialize_global_process_group_ray


def _value_model_with_config_attention(original: Callable[..., Any]) -> Callable[..., Any]:
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


def _unpinned_offload_policy(original: Callable[..., Any]) -> Callable[..., Any]:
    def CPUOffloadPolicy(*args, **kwargs):  # noqa: N802 (stands in for the class of that name)
        kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    return CPUOffloadPolicy


CPU_PATCHES: list[Patch] = [
    Patch(
        module="verl.utils.distributed",
        target="initialize_global_process_group_ray",
        wrap=_gloo_process_group,
        why=(
            "its default backend f'cpu:gloo,{device}:{ccl}' (distributed.py:89) becomes the invalid "
            "'cpu:gloo,cpu:gloo' on a CPU platform; plain 'gloo' is what a CPU process group needs"
        ),
        versions=VERL_VERSIONS,
    ),
    Patch(
        module="verl.utils.model",
        target="load_valuehead_model",
        wrap=_value_model_with_config_attention,
        why=(
            "the critic's value model is loaded with a hard-coded attn_implementation='flash_attention_2' "
            "(model.py:649,674), which needs CUDA; the config's own attention (sdpa on CPU) is used instead"
        ),
        versions=VERL_VERSIONS,
    ),
    Patch(
        module="verl.workers.engine.fsdp.transformer_impl",
        target="CPUOffloadPolicy",
        wrap=_unpinned_offload_policy,
        why=(
            "the FSDP2 reference model is always built with CPUOffloadPolicy(pin_memory=True) "
            "(transformer_impl.py:462); pinning host memory needs an accelerator"
        ),
        versions=VERL_VERSIONS,
    ),
]


def _register_platform(platform_manager) -> None:
    from verl_ext.cpu.platform import PlatformCPU

    platform_manager.PlatformRegistry.register(platform=PLATFORM_NAME)(PlatformCPU)
    # verl resolves its platform once per process, on the first get_platform() call, and caches it.
    # If that call came before the backend was activated (a plugin loaded late), the cached platform
    # is verl's CUDA fallback: replace it (verl logs a warning when it does).
    current = platform_manager._current_platform
    if current is not None and current.device_name != PlatformCPU().device_name:
        platform_manager.set_platform(PlatformCPU())


def _register_fsdp_engines(transformer_impl) -> None:
    # verl registers its FSDP engines for devices ["cuda", "npu"] only (transformer_impl.py:1143,1594),
    # so EngineRegistry.get_engine_cls finds nothing for device "cpu". The same classes serve CPU.
    from verl.workers.engine.base import EngineRegistry

    for model_type, engine_cls in (
        ("language_model", transformer_impl.FSDPEngineWithLMHead),
        ("value_model", transformer_impl.FSDPEngineWithValueHead),
    ):
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("fsdp2", {}):
            EngineRegistry.register(model_type=model_type, backend=["fsdp", "fsdp2"], device="cpu")(engine_cls)


def _register_rollout_adapter(rollout_base) -> None:
    # Worker side: ActorRolloutRefWorker builds its rollout with get_rollout_class(name, "async").
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = "verl_ext.cpu.rollout.HFServerAdapter"


def _register_rollout_replica(replica) -> None:
    # Trainer side: LLMServerManager starts servers through RolloutReplicaRegistry.get(name).
    def load_hf_replica():
        from verl_ext.cpu.rollout import HFReplica

        return HFReplica

    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, load_hf_replica)


def _register_llama_token_family(continuous_token_wiring) -> None:
    # The agent loop looks up a Continuous Token builder by config.json model_type and warns once per
    # sample (continuous_token_wiring.py:210) for a type it does not list; the tiny model is a llama,
    # which the default builder serves. Naming that here keeps the warning out of every step's output.
    table = continuous_token_wiring._MODEL_TYPE_TO_FAMILY
    table.setdefault("llama", continuous_token_wiring.ContinuousTokenModelFamily.DEFAULT)


#: (module, callback) pairs run by ``when_imported``: additions through verl's registries.
CPU_REGISTRATIONS: list[tuple[str, Callable[[Any], None]]] = [
    ("verl.plugin.platform.platform_manager", _register_platform),
    ("verl.workers.engine.fsdp.transformer_impl", _register_fsdp_engines),
    ("verl.workers.rollout.base", _register_rollout_adapter),
    ("verl.workers.rollout.replica", _register_rollout_replica),
    ("verl.utils.tokenizer.continuous_token_wiring", _register_llama_token_family),
]
