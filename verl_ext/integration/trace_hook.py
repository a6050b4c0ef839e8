"""Where verl's trainers meet the per-token trace.

The patches in :mod:`verl_ext.integration.patches` call in here at six moments of a training
step; everything returns at once when tracing is off (``verl_ext.trace.dir`` unset), so the
hooks cost nothing then:

* ``session(trainer, kind)`` around ``fit()``: opens the :class:`~verl_ext.trace.writer.TraceWriter`
  (which checks the directory and writes the run record) before the first step, flushes it at
  the end, also when training fails.
* ``record_kl`` inside ``apply_kl_penalty``: kld_t, recomputed with verl's own
  ``core_algos.kl_penalty`` on the same inputs, and the β read before the controller updates.
* ``record_turn_rewards`` in ``compute_advantage``: the per-turn rewards added to the rewards
  (:mod:`.turn_rewards_hook`), by source.
* ``after_advantage`` at the end of ``compute_advantage``: the legacy trainer's batch is captured
  here, with the raw (unwhitened) advantage when the estimator has one.
* ``after_v1_advantage`` after the V1 trainer stored advantages in TransferQueue: the V1 batch is
  read back from TransferQueue, i.e. exactly what its actor and critic will be given.
* ``take_update_reports`` / ``after_update`` when the trainer reduces an update's metrics: the
  per-token reports of the workers' loss functions (:mod:`update_hook`) become the step's update
  tables. A traced step (with ``verl_ext.trace.update`` on) carries the row key that asks the
  workers for them; it is added at capture time, in both trainers.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from verl_ext.integration.agent_turns import TURNS_KEY
from verl_ext.options import TraceOptions


@dataclass
class _Session:
    trainer: Any
    kind: str  # "legacy" or "v1"
    writer: Any
    options: TraceOptions
    pending: dict = field(default_factory=dict)  # what earlier hooks of this step left for the capture

    @property
    def step(self) -> int:
        return int(self.trainer.global_steps)

    def traces_current_step(self) -> bool:
        return self.options.traces_step(self.step)


_active: _Session | None = None


@contextlib.contextmanager
def session(trainer: Any, kind: str) -> Iterator[None]:
    global _active
    options = TraceOptions.from_config(trainer.config)
    if not options.enabled:
        yield
        return
    from verl_ext.trace.writer import TraceWriter

    record = run_record(trainer.config, kind, options)
    _say_where_a_cluster_writes(options.dir, record.node)
    with TraceWriter(options, record) as writer:  # never hides fit()'s error
        _active = _Session(trainer, kind, writer, options)
        try:
            yield
        finally:
            _active = None


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


def record_kl(data: Any, beta: float, kl_penalty: str) -> None:
    if _active is None or not _active.traces_current_step():
        return
    from verl.trainer.ppo import core_algos

    batch = data.batch
    kld = core_algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty=kl_penalty)
    _active.pending.update(kl=kld * batch["response_mask"], kl_coef=float(beta))


def record_turn_rewards(turn_score: torch.Tensor, tool_reward: torch.Tensor) -> None:
    """The per-turn rewards :mod:`.turn_rewards_hook` added to the step's rewards, by source."""
    if _active is None or not _active.traces_current_step():
        return
    _active.pending.update(turn_score=turn_score, tool_reward=tool_reward)


def after_advantage(data: Any, advantage_raw: torch.Tensor | None) -> None:
    """``advantage_raw``: the step's advantage before whitening (the seam's: verl-ext's estimator's, or
    returns − values of verl's GAE); None where there is none to record (verl's grpo, …)."""
    if _active is None or not _active.traces_current_step():
        return
    batch = data.batch
    if _active.kind == "v1":
        _active.pending["advantage_raw"] = advantage_raw  # captured once V1 has stored its results
        return
    _submit(batch, data.non_tensor_batch.get("uid"), advantage_raw, data.non_tensor_batch.get(TURNS_KEY))
    if _active.options.update:
        from verl_ext.integration.update_hook import ROW_KEY

        batch[ROW_KEY] = torch.arange(len(batch["response_mask"]))  # the token table's sample, to the workers


def after_v1_advantage(trainer: Any, batch_meta: Any) -> Any:
    """Capture the V1 step; returns the batch meta the updates should use (with the row key when asked)."""
    if _active is None or not _active.traces_current_step():
        return batch_meta
    import transfer_queue as tq

    from verl_ext.trace.schema import V1_COLUMNS

    wanted = [column.v1_key for column in V1_COLUMNS]
    if not (trainer.config.algorithm.use_kl_in_reward or "turn_score" in _active.pending):
        wanted.remove("token_level_rewards")  # stored only when they differ from the scores (KL, per-turn rewards)
    if batch_meta.fields is not None:
        wanted = [name for name in wanted if name in batch_meta.fields or name == "uid"]
        if "extra_fields" in batch_meta.fields:  # the agent loop's, with verl-ext's record of turns
            wanted.append("extra_fields")
    stored = tq.kv_batch_get(keys=batch_meta.keys, partition_id=batch_meta.partition_id, select_fields=wanted)
    uid = stored.pop("uid").tolist()
    extra_fields = stored.pop("extra_fields").tolist() if "extra_fields" in wanted else None
    agent_turns = None if extra_fields is None else [e.get(TURNS_KEY) if isinstance(e, dict) else None for e in extra_fields]
    prompts = stored.pop("prompts")
    # under verl's batch keys, which the capture reads (the scores are rm_scores in V1)
    tensors = {column.verl_key: _padded(stored[column.v1_key]) for column in V1_COLUMNS if column.v1_key in stored.keys()}
    tensors.setdefault("token_level_rewards", tensors["token_level_scores"])
    tensors["prompts"] = _padded(prompts)  # right-padded here, unlike the legacy batch
    prompt_lengths = prompts.offsets().diff()
    tensors["prompt_mask"] = torch.arange(tensors["prompts"].shape[1]) < prompt_lengths.unsqueeze(1)
    _submit(tensors, uid, _active.pending.get("advantage_raw"), agent_turns)
    if not _active.options.update:
        return batch_meta
    from tensordict import TensorDict

    from verl_ext.integration.update_hook import ROW_KEY

    rows = TensorDict({ROW_KEY: torch.arange(len(batch_meta.keys))}, batch_size=len(batch_meta.keys))
    return tq.kv_batch_put(keys=batch_meta.keys, partition_id=batch_meta.partition_id, fields=rows)


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


def after_update(reports: dict[str, list[dict]], reduced: dict) -> None:
    if _active is None:
        return
    from verl_ext.trace.capture import UpdateCapture

    for kind, parts in reports.items():
        if kind not in LOGGED:
            continue
        logged = {key: float(reduced[key]) for key in LOGGED[kind] if key in reduced}
        _active.writer.submit_update(UpdateCapture(step=_active.step, kind=kind, parts=parts, logged=logged))


def _flatten(value: Any) -> Iterator[dict]:
    """verl's gathering nests the reports in lists (per micro-batch, rank, mini-batch): the reports."""
    if isinstance(value, dict):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flatten(item)


def _submit(batch: Any, uid: Any, advantage_raw: torch.Tensor | None, agent_turns: Any = None) -> None:
    """``agent_turns``: the agent loop's record of each sample's turns (one per row, or None)."""
    from verl_ext.trace.capture import StepCapture
    from verl_ext.trace.schema import FLOAT_COLUMNS

    session = _active
    pending, session.pending = session.pending, {}

    def get(name: str) -> torch.Tensor | None:
        return batch[name] if name in batch.keys() else None

    prompts = get("prompts")
    prompt_mask = get("prompt_mask")
    if prompt_mask is None and prompts is not None and get("attention_mask") is not None:
        prompt_mask = batch["attention_mask"][:, : prompts.shape[1]]  # verl: prompt part, left-padded
    floats = {column.name: get(column.verl_key) for column in FLOAT_COLUMNS if column.verl_key}
    computed = ("kl", "turn_score", "tool_reward")  # by verl-ext
    floats |= {"advantage_raw": advantage_raw} | {name: pending.get(name) for name in computed}
    session.writer.submit(
        StepCapture(
            step=session.step,
            mask=batch["response_mask"],
            token_id=get("responses"),
            uid=None if uid is None else [str(u) for u in uid],
            floats=floats,
            prompts=prompts,
            prompt_mask=prompt_mask,
            kl_coef=pending.get("kl_coef"),
            eos_token_ids=_eos_token_ids(session.trainer),
            max_response_length=session.trainer.config.data.get("max_response_length"),
            agent_turns=None if agent_turns is None else list(agent_turns),
        )
    )


def _eos_token_ids(trainer: Any) -> tuple[int, ...] | None:
    eos = getattr(getattr(trainer, "tokenizer", None), "eos_token_id", None)
    if eos is None:
        return None
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _padded(value: torch.Tensor) -> torch.Tensor:
    return value.to_padded_tensor(padding=0) if getattr(value, "is_nested", False) else value


def run_record(config: Any, kind: str, options: TraceOptions):
    """The run's settings the checker needs (the writer adds the schema version and the steps)."""
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
    )


def _run_estimator(algorithm: Any):
    """The registry's entry for the run's estimator and its settings; (None, None) for an estimator
    verl-ext knows nothing about."""
    from verl_ext import registry

    estimator = registry.lookup(registry.name_of(algorithm.adv_estimator))
    return (None, None) if estimator is None else (estimator, estimator.settings(algorithm))


def update_settings(config: Any) -> dict[str, Any]:
    """How the actor and critic losses are computed and aggregated (what the update checks need)."""
    actor, critic, n = config.actor_rollout_ref.actor, config.get("critic") or {}, int(config.actor_rollout_ref.rollout.n)
    clip = actor.get("clip_ratio", 0.2)
    settings = {
        "actor": {
            "loss_mode": str((actor.get("policy_loss") or {}).get("loss_mode", "vanilla")),
            "loss_agg_mode": str(actor.loss_agg_mode),
            "clip_ratio_low": float(actor.get("clip_ratio_low") if actor.get("clip_ratio_low") is not None else clip),
            "clip_ratio_high": float(actor.get("clip_ratio_high") if actor.get("clip_ratio_high") is not None else clip),
            "clip_ratio_c": float(actor.clip_ratio_c),
            "loss_scale_factor": actor.get("loss_scale_factor"),
            "ppo_epochs": int(actor.get("ppo_epochs", 1)),
            "ppo_mini_batch_size": int(actor.get("ppo_mini_batch_size", 0)) * n,
            "shuffle": bool(actor.get("shuffle", False)),
            "entropy_coeff": float(actor.get("entropy_coeff", 0.0)),
            "calculate_entropy": bool(actor.get("calculate_entropy", False)),
        },
    }
    if critic:
        settings["critic"] = {
            "cliprange_value": float(critic.cliprange_value),
            "loss_agg_mode": str(critic.loss_agg_mode),
            "loss_scale_factor": critic.get("loss_scale_factor"),
            "ppo_epochs": int(critic.get("ppo_epochs", 1)),
            "ppo_mini_batch_size": int(critic.get("ppo_mini_batch_size", 0)) * n,
        }
    return settings
