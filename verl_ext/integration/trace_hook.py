"""Where verl's trainers meet the per-token trace.

The patches in :mod:`verl_ext.integration.patches` call in here at four moments of a training
step; everything returns at once when tracing is off (``verl_ext.trace.dir`` unset), so the
hooks cost nothing then:

* ``session(trainer, kind)`` around ``fit()``: opens the :class:`~verl_ext.trace.writer.TraceWriter`
  (which checks the directory and writes the run record) before the first step, flushes it at
  the end, also when training fails.
* ``record_kl`` inside ``apply_kl_penalty``: kld_t, recomputed with verl's own
  ``core_algos.kl_penalty`` on the same inputs, and the β read before the controller updates.
* ``after_advantage`` at the end of ``compute_advantage``: the legacy trainer's batch is captured
  here, with the raw (unwhitened) advantage when the estimator has one.
* ``after_v1_advantage`` after the V1 trainer stored advantages in TransferQueue: the V1 batch is
  read back from TransferQueue, i.e. exactly what its actor and critic will be given.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

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

    with TraceWriter(options, run_record(trainer.config, kind, options)) as writer:  # never hides fit()'s error
        _active = _Session(trainer, kind, writer, options)
        try:
            yield
        finally:
            _active = None


def record_kl(data: Any, beta: float, kl_penalty: str) -> None:
    if _active is None or not _active.traces_current_step():
        return
    from verl.trainer.ppo import core_algos

    batch = data.batch
    kld = core_algos.kl_penalty(batch["old_log_probs"], batch["ref_log_prob"], kl_penalty=kl_penalty)
    _active.pending.update(kl=kld * batch["response_mask"], kl_coef=float(beta))


def after_advantage(data: Any, estimator: str, advantage_raw: torch.Tensor | None) -> None:
    if _active is None or not _active.traces_current_step():
        return
    batch = data.batch
    if advantage_raw is None and estimator == "gae":
        advantage_raw = batch["returns"] - batch["values"]  # verl's GAE: returns = raw advantage + values
    if _active.kind == "v1":
        _active.pending["advantage_raw"] = advantage_raw  # captured once V1 has stored its results
        return
    _submit(batch, data.non_tensor_batch.get("uid"), advantage_raw)


def after_v1_advantage(trainer: Any, batch_meta: Any) -> None:
    if _active is None or not _active.traces_current_step():
        return
    import transfer_queue as tq

    wanted = [
        "uid", "prompts", "responses", "response_mask", "rm_scores", "token_level_rewards",
        "values", "advantages", "returns", "old_log_probs", "ref_log_prob",
    ]  # fmt: skip
    if not trainer.config.algorithm.use_kl_in_reward:
        wanted.remove("token_level_rewards")  # V1 stores rewards only when they differ from the scores
    stored = tq.kv_batch_get(keys=batch_meta.keys, partition_id=batch_meta.partition_id, select_fields=wanted)
    uid = stored.pop("uid").tolist()
    prompts = stored.pop("prompts")
    tensors = {name: _padded(value) for name, value in stored.items()}
    tensors["token_level_scores"] = tensors.pop("rm_scores")
    tensors.setdefault("token_level_rewards", tensors["token_level_scores"])
    tensors["prompts"] = _padded(prompts)  # right-padded here, unlike the legacy batch
    prompt_lengths = prompts.offsets().diff()
    tensors["prompt_mask"] = torch.arange(tensors["prompts"].shape[1]) < prompt_lengths.unsqueeze(1)
    _submit(tensors, uid, _active.pending.get("advantage_raw"))


def _submit(batch: Any, uid: Any, advantage_raw: torch.Tensor | None) -> None:
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
    floats |= {"advantage_raw": advantage_raw, "kl": pending.get("kl")}  # computed by verl-ext
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
        )
    )


def _padded(value: torch.Tensor) -> torch.Tensor:
    return value.to_padded_tensor(padding=0) if getattr(value, "is_nested", False) else value


def run_record(config: Any, kind: str, options: TraceOptions):
    """The run's settings the checker needs (the writer adds the schema version and the steps)."""
    import verl
    from omegaconf import OmegaConf

    import verl_ext
    from verl_ext import registry
    from verl_ext.integration.patches import estimator_name
    from verl_ext.trace.schema import RunRecord

    algorithm = config.algorithm
    name = estimator_name(algorithm.adv_estimator)
    settings: dict[str, Any] = {"adv_estimator": name, "gamma": float(algorithm.gamma), "lam": float(algorithm.lam)}
    if name in registry.names():
        estimator = registry.get(name)
        parsed = estimator.settings(algorithm)
        settings |= {option.key: parsed[option.key] for option in estimator.all_options}
        settings["estimator_module"] = estimator.module
    else:
        settings["whiten_advantages"] = True if name == "gae" else None  # verl's GAE always whitens
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
    )
