"""The model replay of ``verl-ext replay --checkpoint``: verl's own actor and critic workers rebuilt in
one process from the run's recorded config, loaded from the checkpoint verl saved before the step,
fed the step's batch rebuilt from the trace, and updated as the trainer updated them
(``RayPPOTrainer._update_critic`` and ``_update_actor``, verl's own methods). The update hook
records the replayed update, as it recorded the run's; the workers then save a checkpoint, which
the parent compares with the one verl saved after the step.

It runs in a fresh interpreter (``python -m verl_ext.apps.replay_model REQUEST.json``), because the
CPU backend must be active before verl is imported and the workers need a process group of their
own: :func:`run_replay` starts it and reads what it wrote. This build uses the CPU backend's
in-process workers (verl_ext.cpu.in_process): it replays runs that trained on a CPU (a GPU run's
kernels would round otherwise), on one rank.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from verl_ext.apps.replay import (
    Overrides,
    ReplayError,
    check_overrides,
    clip_changes_line,
    estimate_overrides,
    replayed_algorithm,
    replayed_correction,
)

#: The columns of each update table the replay must reproduce; the rest are keys or copies of inputs.
COMPARED = {
    "actor": ("log_prob", "old_log_prob", "ratio", "advantage", "pg_loss", "clip", "entropy", "is_weight"),
    "critic": ("vpred", "vpred_clipped", "value", "return", "vf_loss", "vf_clipped"),
}
KEYS = ("sample", "token_index", "epoch", "minibatch", "microbatch", "rank")
#: The limit on a float's difference, × max(1, |recorded|), by the dtype the loss computed in: fp32 as
#: the issue's proof asks (1e-6); bf16 and fp16 a few roundings in that dtype (docs/definitions.md#tolerances).
LIMIT = {"fp32": 1e-6, None: 1e-6, "bf16": 8 * 2.0**-7, "fp16": 8 * 2.0**-10}
MODEL_FILE = "model_world_size_1_rank_0.pt"

#: The batch keys the update reads, from the token table's columns (verl's legacy batch names).
#: ``rollout_is_weights``: verl's rollout-correction weights, which its policy loss multiplies into each
#: token's term (absent from the batch, as in the run, where the trace has none).
FLOAT_KEYS = {
    "old_log_probs": "old_log_prob",
    "ref_log_prob": "ref_log_prob",
    "advantages": "advantage",
    "returns": "return",
    "values": "value",
    "rollout_log_probs": "rollout_log_prob",
    "token_level_rewards": "reward",
    "token_level_scores": "score",
    "rollout_is_weights": "rollout_is_weight",
}


@dataclass
class ModelReplay:
    """One step's whole update run again by verl's workers from the checkpoint before it."""

    trace_path: str
    step: int
    overrides: Overrides
    checkpoint: Path  # the run's checkpoint directory (global_step_<n> folders)
    recorded: dict[str, pa.Table]  # kind -> the recorded update table
    replayed: dict[str, pa.Table]  # kind -> the replayed one, same order
    entries: dict[str, Any]  # kind -> the replayed table's UpdateEntry (its logged metrics: the replay's)
    #: the first difference beyond LIMIT: (kind, sample, token_index, epoch, column, recorded, replayed)
    difference: tuple | None
    bitwise: dict[str, tuple[int, int]]  # kind -> (rows equal bit for bit in every compared column, rows)
    #: kind -> (tensors equal bit for bit, tensors, max |Δ|) against verl's checkpoint after the step; None without one
    parameters: dict[str, tuple[int, int, float]] | None
    #: the actor's log-probs of the step's tokens after the step: "replayed", "recorded" (None without
    #: verl's checkpoint after the step), "mask", each (B, T)
    after: dict[str, np.ndarray | None]
    algorithm: dict[str, Any]
    update: dict[str, Any]  # the run record's update settings of the replayed config
    tokens: pa.Table | None = None
    whiten: dict[str, float] | None = None
    #: what another rollout correction changed (verl_ext.apps.replay_correction.CorrectionChange); None: the run's
    correction: Any = None

    #: kind -> verl's logged metrics of the recorded update
    logged: dict[str, dict[str, float]] | None = None
    #: which of verl's checkpoints hold the weights before and after the update (:func:`update_checkpoints`)
    checkpoints: "UpdateCheckpoints | None" = None

    def recorded_logged(self, kind: str) -> dict[str, float]:
        return (self.logged or {}).get(kind, {})

    @property
    def reproduced(self) -> bool:
        """As recorded (no overrides): the tables and the parameters after the step equal the run's."""
        if self.overrides.given:
            return True  # a what-if is no verdict on the recording
        return self.difference is None and all(equal == total for equal, total, _ in (self.parameters or {}).values())


def checkpoint_root(trace, given: str | None) -> Path | None:
    """Where the run saved its checkpoints: ``given``, else the recorded ``trainer.default_local_dir``
    (None when the trace records no config)."""
    if given is not None:
        return Path(given)
    config = trace.record.config or {}
    directory = (config.get("trainer") or {}).get("default_local_dir")
    return None if directory is None else Path(directory)


def has_checkpoint_for(root: Path | None, step: int, trace=None) -> bool:
    """The checkpoint the replay of ``step`` starts from is there (verl's first step starts from the model the
    config names); with ``trace``, the one :func:`update_checkpoints` names (none for an update no checkpoint of
    verl's holds the start of)."""
    if root is None:
        return False
    if trace is None:
        return step == 1 or (root / f"global_step_{step - 1}").is_dir()
    try:
        before = update_checkpoints(trace, step).before
    except ReplayError:
        return False
    return before is None or (root / f"global_step_{before}").is_dir()


@dataclass(frozen=True)
class UpdateCheckpoints:
    """Which of verl's checkpoints (``global_step_<n>`` folders) hold the weights an update starts from and
    those right after it."""

    verl_step: int  # verl's own step of the update (trainer.critic_warmup counts these)
    before: int | None  # global_step_<before>; None: the models the config names, with a fresh optimizer (verl's first update)
    after: int | None  # global_step_<after>; None: no checkpoint holds the weights right after this update
    why_no_after: str | None = None  # why, where after is None though a checkpoint follows the update
    place: str | None = None  # where the update sits in an asynchronous run, and the mode (None: a synchronous run)


def update_checkpoints(trace, step: int) -> UpdateCheckpoints:
    """The checkpoints of the update of trace step ``step`` (docs/definitions.md#policy-versions). verl saves one
    per step of its own (``global_step_<n>``: the weights after step n), and fully async one per weight sync
    (``global_step_<version>``). A synchronous or one-step-off update n starts from ``global_step_<n−1>``; a V1
    separate_async step's first update from the checkpoint of the step before, and a fully async version's first
    update from the checkpoint of that version; none holds where a later update of a step or a version starts
    (the weights after the local updates before it): ReplayError, one line."""
    from verl_ext.steps.versions import StepPlace, describe_mode, may_be_asynchronous

    place = StepPlace.of(trace, step)
    if not may_be_asynchronous(trace.record) or not place.asynchronous:
        return UpdateCheckpoints(step, step - 1 if step > 1 else None, step)
    mode, name, verl_step = describe_mode(trace.record.mode) or "an asynchronous mode", place.mode_name, place.verl_step
    where = f"step {step} is {place.describe()} ({mode})"
    if place.substep:  # a later update of a step (separate_async) or of a version (fully async)
        of = f"version {place.trainer_version}" if name == "fully_async" else f"verl's step {verl_step}"
        saved = "at a weight sync (global_step_<version>)" if name == "fully_async" else "after a whole step of its own (global_step_<n>)"
        raise ReplayError(
            f"{where}: update {place.substep + 1} of {of} starts from the weights after its {place.substep} update(s) before it, and "
            f"verl saves a checkpoint only {saved}: none holds them"
        )
    if name == "fully_async":
        version = place.trainer_version
        if version is None:
            raise ReplayError(f"{where}: fully async names its checkpoints by weight version, and the trace does not say this update's")
        after, why = (version + 1, None) if place.substep is None else (None, f"global_step_{version + 1} holds the weights after every update of version {version}")
        return UpdateCheckpoints(verl_step, version or None, after, why, f"{place.describe()}; mode {mode}")
    if name in ("separate_async", "colocate_async") and (place.updates or 1) > 1:
        why = f"verl's checkpoint of step {verl_step} holds the weights after all {place.updates} of its updates"
        return UpdateCheckpoints(verl_step, verl_step - 1 or None, None, why, f"{place.describe()}; mode {mode}")
    return UpdateCheckpoints(verl_step, verl_step - 1 or None, verl_step, None, f"{place.describe()}; mode {mode}")


def replay_with_model(trace, step: int, overrides: Overrides, root: Path, progress: Callable[[str], None] | None = None) -> ModelReplay:
    """Replay ``step`` of ``trace`` with verl's workers from the checkpoints under ``root`` (module
    docstring); ``progress(line)`` once the input checks passed and the workers' process starts."""
    from omegaconf import OmegaConf

    from verl_ext.apps.replay import reestimated_tokens
    from verl_ext.integration.run_record import update_settings
    from verl_ext.trace.schema import UpdateEntry

    trace.require_step(step)
    kinds = [kind for kind in ("actor", "critic") if step in trace.update_steps.get(kind, [])]
    if not kinds:
        raise ReplayError(f"step {step} of {trace.path} has no update tables: a replay needs what the update did (verl_ext.trace.update=true)")
    if trace.record.config is None:
        raise ReplayError(f"{trace.path}: the run record holds no verl config (a trace before format 9), which the model replay rebuilds the workers from; --model-free replays the first mini-batch")
    device = (trace.record.config.get("trainer") or {}).get("device")
    if device != "cpu":
        raise ReplayError(
            f"the run trained on {device!r}; the model replay runs verl's workers on the CPU backend (one process), where "
            "another device's kernels would round otherwise: built for CPU runs only; --model-free replays the first mini-batch"
        )
    ranks = max(int(m.get("dp_size") or 1) for kind in kinds for m in trace.update_record(kind, step).minibatches)
    if ranks > 1:
        raise ReplayError(f"step {step} trained on {ranks} data-parallel ranks, and the replay runs one; --model-free replays the first mini-batch")
    config = OmegaConf.create(trace.record.config)
    for item in overrides.config:
        key = item.partition("=")[0]
        if ".optim." in key:
            raise ReplayError(f"override {key}: verl restores the optimizer and its schedule (the learning rate too) from the checkpoint, over the config")
        if OmegaConf.select(config, key, default=KeyError) is KeyError:
            raise ReplayError(f"override {key}: not a key of the run's verl config")
    check_overrides(trace, overrides, model=True)  # a value verl's config or verl-ext refuses: before any worker
    try:
        checkpoints = update_checkpoints(trace, step)
    except ReplayError as error:  # an update no checkpoint holds the start of: one line
        raise ReplayError(f"{error}; --model-free replays its first mini-batch") from None
    if checkpoints.before is not None:
        _require_the_runs_model(root / f"global_step_{checkpoints.before}", config)
    correction = replayed_correction(trace, overrides.algorithm)
    algorithm = replayed_algorithm(trace, overrides, correction)
    tokens, whiten, change = None, None, None
    if correction.given:  # its mask, rejection and weights; verl's own mini-batching then trains what it keeps
        from verl_ext.apps.replay_correction import corrected_tokens

        tokens, change = corrected_tokens(trace, step, correction)
    if estimate_overrides(overrides) or (change is not None and change.mask_changed):
        tokens, whiten, _ = reestimated_tokens(trace, step, algorithm, None, tokens)
    work = Path(tempfile.mkdtemp(prefix="verl-ext-replay-"))
    if tokens is not None:
        pq.write_table(tokens, work / "tokens.parquet")
    if progress is not None:
        progress(f"step {step} with verl's workers, from {root} (a fresh process: seconds on a tiny model) ...")
    # ``work`` goes once read; where the workers failed, too (an unexpected failure keeps their log beside it: the error names it)
    result = run_replay(str(trace.path), step, str(root), work, overrides.config, str(work / "tokens.parquet") if tokens is not None else None,
                        checkpoints)  # fmt: skip
    try:
        recorded = {kind: trace.update_table(kind, step) for kind in kinds}
        replayed = {kind: pq.read_table(work / f"{kind}.parquet") for kind in result["tables"]}
        with np.load(work / "after.npz") as saved:
            after = {"replayed": saved["replayed"], "recorded": saved["recorded"] if "recorded" in saved else None, "mask": saved["mask"]}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    entries = {kind: UpdateEntry(**table["entry"]) for kind, table in result["tables"].items()}
    if set(replayed) != set(recorded):
        raise ReplayError(f"the replay updated {', '.join(sorted(replayed)) or 'nothing'}, the run {', '.join(kinds)} (trainer.critic_warmup?)")
    dtypes = {kind: ((trace.record.update or {}).get(kind) or {}).get("dtype") for kind in kinds}
    difference, bitwise = _first_difference(recorded, replayed, dtypes)
    parameters = result["parameters"]
    if parameters and any(problem for problem in parameters.values() if isinstance(problem, str)):
        raise ReplayError(next(problem for problem in parameters.values() if isinstance(problem, str)))
    merged = OmegaConf.merge(config, OmegaConf.from_dotlist(overrides.config)) if overrides.config else config
    return ModelReplay(
        trace_path=str(trace.path), step=step, overrides=overrides, checkpoint=root, recorded=recorded, replayed=replayed,
        entries=entries, difference=difference, bitwise=bitwise, parameters=parameters, after=after,
        algorithm=algorithm, update=update_settings(merged), tokens=tokens, whiten=whiten,
        logged={kind: trace.update_record(kind, step).logged for kind in kinds}, correction=change, checkpoints=checkpoints,
    )  # fmt: skip


def _require_the_runs_model(checkpoint: Path, config) -> None:
    """ReplayError when ``checkpoint`` (a global_step_<n> folder) is missing or holds another model than
    the run's: the architecture verl saved beside it (huggingface/config.json) against the model path's."""
    if not checkpoint.is_dir():
        raise ReplayError(f"no checkpoint at {checkpoint}: the run saved none there (trainer.save_freq), or --checkpoint names another directory")
    for kind, model in (("actor", config.actor_rollout_ref.model.path), ("critic", (config.get("critic") or {}).get("model", {}).get("path"))):
        saved, own = checkpoint / kind / "huggingface" / "config.json", Path(str(model)) / "config.json" if model else None
        if not saved.is_file() or own is None or not own.is_file():
            continue
        keys = ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
        theirs, ours = json.loads(saved.read_text()), json.loads(own.read_text())
        if any(theirs.get(key) != ours.get(key) for key in keys):
            raise ReplayError(f"{checkpoint / kind} holds another model than the run's ({model}): a checkpoint of another run?")


def _first_difference(recorded: dict[str, pa.Table], replayed: dict[str, pa.Table], dtypes: dict) -> tuple[tuple | None, dict]:
    """The first row (actor first, in the tables' order) and column where a replayed table differs from
    the recorded one beyond :data:`LIMIT`, and per kind (rows equal bit for bit, rows)."""
    first, bitwise = None, {}
    for kind, table in recorded.items():
        other = replayed[kind]
        if other.num_rows != table.num_rows or any(not table[key].equals(other[key]) for key in KEYS):
            return (kind, None, None, None, "rows", f"{table.num_rows} rows", f"{other.num_rows} rows, or others in another order"), bitwise
        same = np.ones(table.num_rows, bool)
        bad = np.zeros(table.num_rows, bool)
        columns = {}
        for column in COMPARED[kind]:
            a = table[column].to_numpy(zero_copy_only=False)
            b = other[column].to_numpy(zero_copy_only=False)
            if a.dtype.kind == "f":
                both_nan = np.isnan(a) & np.isnan(b)
                same &= (a.view(np.uint32) == b.view(np.uint32)) | both_nan
                close = both_nan | (np.abs(a.astype(np.float64) - b) <= LIMIT.get(dtypes[kind], 1e-6) * np.maximum(1.0, np.abs(a)))
            else:
                close = np.asarray(a == b, bool)
                same &= close
            columns[column] = ~close
            bad |= ~close
        bitwise[kind] = (int(same.sum()), table.num_rows)
        if first is None and bad.any():
            row = int(np.argmax(bad))
            column = next(c for c in COMPARED[kind] if columns[c][row])
            first = (kind, table["sample"][row].as_py(), table["token_index"][row].as_py(), table["epoch"][row].as_py(),
                     column, table[column][row].as_py(), other[column][row].as_py())  # fmt: skip
    return first, bitwise


def _compare_parameters(replayed: Path, saved: Path) -> tuple[int, int, float] | str:
    """(tensors equal bit for bit, tensors, max |Δ|) of two one-rank model checkpoints of verl (read in
    the workers' process, where their device mesh is); what is wrong, when they do not compare."""
    import torch

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        state = torch.load(path, map_location="cpu", weights_only=False)
        return {name: (value.full_tensor() if hasattr(value, "full_tensor") else value).float() for name, value in state.items()}

    if not saved.is_file():
        return f"{saved} is missing: a checkpoint that is not verl's one-rank FSDP checkpoint"
    a, b = tensors(replayed), tensors(saved)
    if set(a) != set(b) or any(a[name].shape != b[name].shape for name in a):
        return f"{saved} holds other parameters than the replayed model: a checkpoint of another run?"
    equal = sum(torch.equal(a[name], b[name]) for name in a)
    largest = max((float((a[name] - b[name]).abs().max()) for name in a if a[name].numel()), default=0.0)
    return equal, len(a), largest


def model_report(replay: ModelReplay, fmt: str = "text", top: int = 10) -> str:
    """The verdict as recorded (update tables and parameters), and with overrides what moved: verl's
    logged metrics, the clip codes, and the policy after the step on the step's own tokens."""
    step = replay.step
    checkpoints = replay.checkpoints or UpdateCheckpoints(step, step - 1 if step > 1 else None, step)
    before = replay.checkpoint / f"global_step_{checkpoints.before}"
    if checkpoints.before is None:
        start = "the model the config names, with a fresh optimizer (step 1)" if checkpoints.place is None else "the model the config names, with a fresh optimizer (verl's first update)"
    else:
        start = f"the checkpoint of step {checkpoints.before} ({before})" if checkpoints.place is None else f"verl's checkpoint {before.name} ({before})"
    rows = {kind: table.num_rows for kind, table in replay.recorded.items()}
    moved = _moved_tokens(replay, top)
    logged = {kind: {key: [replay.recorded_logged(kind).get(key), value] for key, value in entry.logged.items()} for kind, entry in replay.entries.items()}
    clip, clip_only = _clip_changes(replay)
    data = {
        "trace": replay.trace_path, "step": step, "mode": "model", "start": str(before) if checkpoints.before is not None else None,
        **({} if checkpoints.place is None else {"update": checkpoints.place}),
        "as_recorded": None if replay.overrides.given else "REPRODUCED" if replay.reproduced else "DIFFERS", "rows": rows, "bitwise": replay.bitwise,
        "difference": None if replay.difference is None else dict(zip(("kind", "sample", "token_index", "epoch", "column", "recorded", "replayed"), replay.difference)),
        "parameters": replay.parameters, "overrides": replay.overrides.given, "logged": logged, "clip_changes": clip,
        "clip_only": {side: {str(epoch): part for epoch, part in parts.items()} for side, parts in clip_only.items()}, "moved": moved,
        "correction": None if replay.correction is None else replay.correction.as_dict(),
    }  # fmt: skip
    if fmt == "json":
        return json.dumps(data, indent=1, default=float)
    lines = [f"step {step} of {replay.trace_path}, with the model: verl's workers from {start}, updated by verl's own "
             f"update methods on the step's batch rebuilt from the trace ({', '.join(f'{kind} {n} rows' for kind, n in rows.items())})"]  # fmt: skip
    if checkpoints.place is not None:
        lines.append(f"the update: {checkpoints.place}")
    if replay.overrides.given:
        lines.append("as recorded: not replayed here (overrides given: run it without them for the proof)")
    elif replay.difference is not None:
        kind, sample, token, epoch, column, before_value, after_value = replay.difference
        where = f"{kind} update, sample {sample}, token {token}, epoch {epoch}" if sample is not None else f"{kind} update"
        lines.append(f"as recorded: DIFFERS at {where}: {column} recorded {before_value}, replayed {after_value}")
    else:
        tables = ", ".join(f"{kind} {equal} of {total} rows bit for bit" for kind, (equal, total) in replay.bitwise.items())
        verdict = "REPRODUCED" if replay.reproduced else "DIFFERS"
        lines.append(f"as recorded: {verdict}: the update tables equal the recorded ones ({tables}; the rest within the limit of docs/inspecting.md#replaying-a-step)")
    if replay.parameters is None and checkpoints.why_no_after is not None:
        lines.append(f"  parameters after the step: not compared ({checkpoints.why_no_after})")
    elif replay.parameters is None:
        lines.append(f"  parameters after the step: not compared (no checkpoint of step {checkpoints.after} under {replay.checkpoint})")
    else:
        lines.append(f"  parameters after the {'replayed ' if replay.overrides.given else ''}step against verl's checkpoint of step {checkpoints.after}: "
                     + ", ".join(f"{kind} {equal} of {total} tensors bit for bit (max |Δ| {largest:.3g})" for kind, (equal, total, largest) in replay.parameters.items()))  # fmt: skip
    if not replay.overrides.given:
        return "\n".join(lines)
    lines.append(f"with {' '.join(replay.overrides.given)}:")
    if replay.correction is not None:
        lines.append(replay.correction.line())
    for kind, metrics in logged.items():
        lines.append(f"  {kind}: " + ", ".join(f"{key} {_number(a)} → {_number(b)}" for key, (a, b) in metrics.items()))
    lines.append(_clip_line(clip, clip_only, _epochs_of_both(replay)))
    if replay.after["recorded"] is not None:
        mask = replay.after["mask"]
        delta = (replay.after["replayed"] - replay.after["recorded"])[mask]
        lines.append(f"  the policy after the step, on the step's {int(mask.sum())} valid tokens: mean |Δ log π| {np.abs(delta).mean():.4g}, "
                     f"mean (log π_recorded − log π_replayed) {(-delta).mean():.4g} (over tokens the old policy sampled: not a KL, "
                     "which would sample from one of the two)")  # fmt: skip
        if not moved:
            lines.append("  no token's log-prob after the step moved")
            return "\n".join(lines)
        lines.append("  tokens whose log-prob after the step moved most (recorded → replayed):")
        lines.append(f"    {'sample':>6} {'token':>5} {'log π after':>23}")
        for row in moved:
            lines.append(f"    {row['sample']:>6} {row['token_index']:>5} {row['log_prob_after'][0]:>10.4f} → {row['log_prob_after'][1]:<10.4f}")
    return "\n".join(lines)


def _number(value) -> str:
    return "—" if value is None else f"{value:.6g}"


def _clip_changes(replay: ModelReplay) -> tuple[dict[str, int], dict[str, dict[int, dict]]]:
    """"recorded→replayed" clip codes, counted over the actor's rows both updates trained (joined on
    epoch, sample and token: other mini-batch sizes change the rows' places); and the rows only one of
    them trained (another number of epochs): {"recorded" | "replayed": {epoch: {"tokens": n, "clipped":
    {code: n}, "whole": the other update has no row of that epoch}}}."""
    if "actor" not in replay.recorded or "actor" not in replay.replayed:
        return {}, {}
    from verl_ext.apps.replay import clip_transitions

    keys = ["epoch", "sample", "token_index"]
    before = replay.recorded["actor"].select([*keys, "clip"]).to_pandas()
    after = replay.replayed["actor"].select([*keys, "clip"]).to_pandas()
    joined = before.merge(after, on=keys, how="outer", suffixes=("_recorded", "_replayed"), indicator=True)
    both = joined[joined["_merge"] == "both"]
    only: dict[str, dict[int, dict]] = {}
    for side, flag, other in (("recorded", "left_only", after), ("replayed", "right_only", before)):
        for epoch, rows in joined[joined["_merge"] == flag].groupby("epoch"):
            codes = rows[f"clip_{side}"].astype(str)
            clipped = codes[codes != "none"].value_counts()
            only.setdefault(side, {})[int(epoch)] = {
                "tokens": len(rows), "clipped": {str(code): int(n) for code, n in sorted(clipped.items())},
                "whole": not (other["epoch"] == epoch).any(),
            }  # fmt: skip
    transitions = clip_transitions(both["clip_recorded"].to_numpy().astype(str), both["clip_replayed"].to_numpy().astype(str))
    return transitions, only


def _clip_line(transitions: dict[str, int], only: dict[str, dict[int, dict]], epochs: list[int]) -> str:
    """The clip codes that changed on the tokens both updates trained, and what one of them alone trained."""
    line = clip_changes_line(transitions)
    if not only:
        return line
    line += f" (on epoch{'s' if len(epochs) > 1 else ''} {', '.join(map(str, epochs))}, which both updates ran)"
    for side, label in (("replayed", "the replay"), ("recorded", "the recorded update")):
        for epoch, part in sorted(only.get(side, {}).items()):
            clipped = sum(part["clipped"].values())
            codes = f" ({', '.join(f'{code} on {n}' for code, n in part['clipped'].items())})" if clipped else ""
            if part["whole"]:
                line += f"; epoch {epoch} is only in {label}: {clipped} of its {part['tokens']} tokens clipped{codes}"
            else:
                line += f"; {part['tokens']} tokens of epoch {epoch} are only in {label}: {clipped} clipped{codes}"
    return line


def _epochs_of_both(replay: ModelReplay) -> list[int]:
    """The PPO epochs both actor updates ran."""
    if "actor" not in replay.recorded or "actor" not in replay.replayed:
        return []
    return sorted(set(replay.recorded["actor"]["epoch"].to_pylist()) & set(replay.replayed["actor"]["epoch"].to_pylist()))


def _moved_tokens(replay: ModelReplay, top: int) -> list[dict[str, Any]]:
    """The ``top`` valid tokens whose log-prob after the step differs most between the recorded and
    the replayed policy (none without verl's checkpoint after the step)."""
    if replay.after["recorded"] is None:
        return []
    mask = replay.after["mask"]
    delta = np.where(mask, np.abs(replay.after["replayed"] - replay.after["recorded"]), -1.0)
    order = np.argsort(-delta, axis=None, kind="stable")[:top]
    rows = []
    for flat in order:
        sample, token = np.unravel_index(flat, delta.shape)
        if delta[sample, token] <= 0:
            break
        rows.append({"sample": int(sample), "token_index": int(token),
                     "log_prob_after": [float(replay.after["recorded"][sample, token]), float(replay.after["replayed"][sample, token])]})  # fmt: skip
    return rows


def write_model_replay(replay: ModelReplay, trace, out: str) -> Path:
    """The model replay as a trace at ``out`` (verl_ext.apps.replay.write_replay_trace): every replayed
    update table, whole."""
    from verl_ext.apps.replay import write_replay_trace

    return write_replay_trace(
        trace, replay.step, out, algorithm=replay.algorithm, update=replay.update,
        updates={kind: (table, replay.entries[kind]) for kind, table in replay.replayed.items()}, tokens=replay.tokens, whiten=replay.whiten,
        replay={"of": replay.trace_path, "step": replay.step, "mode": "model", "overrides": replay.overrides.given,
                "checkpoint": str(replay.checkpoint), "minibatches": None},
        correction_changed=replay.correction is not None,
    )  # fmt: skip


def run_replay(
    trace_path: str, step: int, checkpoint_root: str, work: Path, overrides: list[str], tokens_file: str | None,
    checkpoints: UpdateCheckpoints | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the replay in a fresh interpreter; its result (``result.json``), with the update tables at
    ``work/<kind>.parquet`` and the replayed checkpoint under ``work/checkpoint``. ``tokens_file``: a
    token table to take the step's advantages and returns from (another estimator's), else the trace's;
    ``checkpoints``: the update's (default: a synchronous run's step ``step``)."""
    work.mkdir(parents=True, exist_ok=True)
    checkpoints = checkpoints or UpdateCheckpoints(step, step - 1 if step > 1 else None, step)
    request = {"trace": trace_path, "step": step, "checkpoint": checkpoint_root, "work": str(work), "overrides": overrides, "tokens": tokens_file,
               "verl_step": checkpoints.verl_step, "before": checkpoints.before, "after": checkpoints.after}  # fmt: skip
    (work / "request.json").write_text(json.dumps(request))
    env = {**os.environ, "VERL_EXT_CPU": "1"}  # the CPU backend's in-process workers (replay_with_model: CPU runs only)
    try:
        process = subprocess.run([sys.executable, "-m", "verl_ext.apps.replay_model", str(work / "request.json")], env=env,
                                 capture_output=True, text=True)  # fmt: skip
    except KeyboardInterrupt:  # the workers' process got the same Ctrl-C; nothing of the replay is worth keeping
        shutil.rmtree(work, ignore_errors=True)
        raise
    (work / "replay.log").write_text(process.stdout + process.stderr)
    result_file = work / "result.json"
    if process.returncode != 0 or not result_file.exists():
        problem = next((line for line in reversed(process.stderr.splitlines()) if line.startswith("verl-ext replay:")), None)
        if problem:  # said in one line: nothing of the work directory is worth keeping
            shutil.rmtree(work, ignore_errors=True)
        else:  # not a refusal of theirs (a bug, the machine): its last line here, their whole output beside, the rest gone
            log = work.with_name(f"{work.name}.log")
            (work / "replay.log").replace(log)
            shutil.rmtree(work, ignore_errors=True)
        raise ReplayError(problem.removeprefix("verl-ext replay: ") if problem else
                          f"the replay's workers failed ({_how_it_ended(process.returncode)}): {last_error(process.stderr)}; their whole output: {log}")  # fmt: skip
    return json.loads(result_file.read_text())


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit {returncode}"


#: What torch.distributed puts before each line a rank prints.
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s?")


def last_error(stderr: str) -> str:
    """The exception a Python process ended with, from its ``stderr``: the first unindented line after the
    last ``Traceback`` (ranks' ``[rank0]: `` prefixes removed); else its last line that is not empty."""
    lines = [_RANK_PREFIX.sub("", line) for line in stderr.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        error = next((line for line in lines[starts[-1] + 1 :] if line.strip() and not line[0].isspace()), None)
        if error is not None:
            return error.strip()
    return next((line.strip() for line in reversed(lines) if line.strip()), "it printed nothing on stderr")


# --------------------------------------------------------------------------- in the fresh interpreter


def rebuild_batch(trace, step: int, config, tokens=None):
    """The step's batch as the trainer's update received it, from the trace: the rows in the trace's
    order (verl's, after balancing), prompts left-padded to the rollout's prompt_length and responses
    right-padded to its response_length, attention over the prompt and every recorded response
    position (holes included), position ids as verl computes them, and the per-token floats of
    :data:`FLOAT_KEYS` (0 where null). ``tokens``: the token table to take them from (default: the trace's)."""
    import torch
    from verl import DataProto

    from verl_ext.integration.trace_hook import rows
    from verl_ext.trace.batch_keys import LOSS_MASK_KEY, ROW_KEY

    entry = trace.step_record(step)
    if entry.samples < entry.batch_samples:
        raise ReplayError(f"step {step} traced {entry.samples} of its {entry.batch_samples} samples: the model replay needs every sample (verl_ext.trace.max_samples_per_step)")
    table = trace.read_step(step) if tokens is None else tokens
    prompts = trace.prompts(step)
    rollout = config.actor_rollout_ref.rollout
    width_p, width_r, batch = int(rollout.prompt_length), int(rollout.response_length), entry.batch_samples
    pad = _pad_token_id(config)
    sample = table["sample"].to_numpy()
    token_index = table["token_index"].to_numpy()
    input_ids = torch.full((batch, width_p + width_r), pad, dtype=torch.int64)
    attention = torch.zeros((batch, width_p + width_r), dtype=torch.int64)
    response_mask = torch.zeros((batch, width_r), dtype=torch.int64)
    for row, ids in zip(prompts["sample"].to_pylist(), prompts["prompt_token_ids"].to_pylist()):
        input_ids[row, width_p - len(ids) : width_p] = torch.tensor(ids, dtype=torch.int64)
        attention[row, width_p - len(ids) : width_p] = 1
    input_ids[sample, width_p + token_index] = torch.from_numpy(table["token_id"].to_numpy().astype(np.int64))
    attention[sample, width_p + token_index] = 1
    response_mask[sample, token_index] = torch.from_numpy(table["mask"].to_numpy().astype(np.int64))
    rejected = table["rejected"].fill_null(False).to_numpy(zero_copy_only=False) if "rejected" in table.column_names else None
    tensors = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": torch.clamp(torch.cumsum(attention, dim=-1) - 1, min=0),
        "prompts": input_ids[:, :width_p],
        "responses": input_ids[:, width_p:],
        "response_mask": response_mask,
    }
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for key, column in FLOAT_KEYS.items():
        values = table[column]
        if values.null_count == len(values):
            continue
        dense = torch.zeros((batch, width_r), dtype=torch.float32)
        dense[sample, token_index] = torch.from_numpy(values.fill_null(0.0).to_numpy().astype(np.float32))
        # in the dtype the trainer's batch held it in (a bf16 run's values, log-probs): exact, the trace stores it as float32
        tensors[key] = dense.to(dtypes.get(entry.stored_dtypes.get(column), torch.float32))
    if trace.record.trainer == "v1" and rejected is not None and rejected.any():
        # verl's V1 trainer divides the loss by the tokens of a loss mask its rollout wrote before the rejection
        # (docs/definitions.md#off-policy-tokens); the legacy trainer's is the response mask (verl_ext.touches)
        loss_mask = response_mask.clone()
        loss_mask[sample[rejected], token_index[rejected]] = 1
        tensors[LOSS_MASK_KEY] = loss_mask
    tensors[ROW_KEY] = rows(batch)
    data = DataProto.from_single_dict(tensors)
    data.meta_info["global_token_num"] = attention.sum(-1).tolist()
    data.meta_info["temperature"] = rollout.temperature  # as the rollout put it on the batch (the critic reads it too)
    return data


def _require_the_runs_initial_critic(trainer, batch, dtype) -> None:
    """ReplayError unless the critic built for step 1 is the one the run started from: its values on the
    step's batch equal the recorded ones (the run's initial critic computed those) within :data:`LIMIT`.
    A value head the model path lacks is drawn at random when verl builds the critic: the CPU backend
    draws it from ``critic.fsdp.seed`` (verl_ext.cpu.patches.value_model_seeded), as the rebuilt one was;
    a run made before it did drew it from an unseeded RNG, and no checkpoint holds it."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    rebuilt = RayPPOTrainer._compute_values(trainer, batch).batch["values"].float().numpy()
    recorded = batch.batch["values"].float().numpy()
    valid = batch.batch["response_mask"].numpy().astype(bool)
    far = valid & ~(np.abs(rebuilt.astype(np.float64) - recorded) <= LIMIT.get(dtype, 1e-6) * np.maximum(1.0, np.abs(recorded)))
    if not far.any():
        return
    sample, token = (int(i) for i in np.argwhere(far)[0])
    config = trainer.config
    path = config.critic.model.path
    where = f"it predicts {rebuilt[sample, token]:.6g} at sample {sample}, token {token}, where the run's critic predicted {recorded[sample, token]:.6g}"
    fresh = _parameters_not_in(path, [name for name, _ in trainer.critic_wg.worker.engine.module.named_parameters()])
    if fresh is None:
        raise ReplayError(f"step 1 cannot be replayed with the model: the critic built from {path} (critic.model.path) is not the one the run "
                          f"started from ({where}): a value head it drew at random, or another model there now")  # fmt: skip
    if not fresh:
        raise ReplayError(f"step 1 cannot be replayed with the model: the critic at {path} (critic.model.path) is not the one the run started from: {where}")
    seed = OmegaConf.select(config, "critic.fsdp.seed")
    raise ReplayError(
        f"step 1 cannot be replayed with the model: the run's critic started with a value head drawn at random ({', '.join(fresh)}, "
        f"which {path} lacks), not from critic.fsdp.seed={seed} as verl-ext's CPU backend now draws it (rebuilt so, {where}), and no "
        "checkpoint holds it; --model-free replays step 1's first mini-batch, the run's checkpoints the steps after it. A run replayable "
        "from step 1: one made with this verl-ext, or one whose critic.model.path holds the value head (a pretrained critic)"
    )


def _parameters_not_in(path, names: list[str]) -> list[str] | None:
    """Those of ``names`` the safetensors files of the model directory ``path`` do not hold (what
    transformers initialised afresh); None where ``path`` holds no safetensors file to read."""
    from safetensors import safe_open

    files = sorted(Path(str(path)).glob("*.safetensors"))
    if not files:
        return None
    saved: set[str] = set()
    for file in files:
        with safe_open(str(file), "pt") as handle:
            saved.update(handle.keys())
    return [name for name in names if name not in saved]


def _pad_token_id(config) -> int:
    from verl.utils import hf_tokenizer

    tokenizer = hf_tokenizer(config.actor_rollout_ref.model.get("tokenizer_path") or config.actor_rollout_ref.model.path)
    return int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)


def _main(request_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    from verl_ext.integration import plugin

    plugin.activate("call")  # the update hook, and with VERL_EXT_CPU=1 the CPU backend, before verl loads
    from types import SimpleNamespace

    from omegaconf import OmegaConf
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.trainer.ppo.utils import need_critic
    from verl.utils.metric import reduce_metrics

    from verl_ext.cpu.in_process import actor_worker_group, critic_worker_group, init_single_rank_process_group
    from verl_ext.integration.trace_hook import LOGGED, take_update_reports
    from verl_ext.trace.reader import open_trace
    from verl_ext.trace.update_files import UpdateCapture, UpdateFiles

    try:
        trace, step, work = open_trace(request["trace"]), int(request["step"]), Path(request["work"])
        if trace.record.config is None:
            raise ReplayError(f"{trace.path}: the run record holds no verl config (a trace before format 9): the model replay rebuilds the workers from it")
        config = OmegaConf.create(trace.record.config)
        if request["overrides"]:
            config = OmegaConf.merge(config, OmegaConf.from_dotlist(request["overrides"]))
        tokens = pq.read_table(request["tokens"]) if request["tokens"] else None
        batch = rebuild_batch(trace, step, config, tokens)
        first = request["before"] is None  # verl's first update starts from the model the config names, with a fresh optimizer
        before = Path(request["checkpoint"]) / f"global_step_{request['before']}"
        init_single_rank_process_group()
        use_critic = need_critic(config)
        critic = critic_worker_group(config) if use_critic else None
        actor = actor_worker_group(config, "actor")
        if not first:
            actor.load_checkpoint(str(before / "actor"), del_local_after_load=False)
            if critic is not None:
                critic.load_checkpoint(str(before / "critic"), del_local_after_load=False)
        trainer = SimpleNamespace(config=config, actor_rollout_wg=actor, critic_wg=critic, distillation_config=None)
        if first and critic is not None:
            _require_the_runs_initial_critic(trainer, batch, ((trace.record.update or {}).get("critic") or {}).get("dtype"))
        outputs = {}
        if critic is not None:
            outputs["critic"] = RayPPOTrainer._update_critic(trainer, batch)
        if config.trainer.critic_warmup <= request["verl_step"]:
            outputs["actor"] = RayPPOTrainer._update_actor(trainer, batch)
        result: dict[str, Any] = {"tables": {}, "logged": {}, "parameters": None}
        for kind, output in outputs.items():
            metrics = dict(output.meta_info["metrics"])
            reports = take_update_reports(metrics).get(kind, [])
            reduced = reduce_metrics(metrics)
            logged = {key: float(reduced[key]) for key in LOGGED[kind] if key in reduced}
            files = UpdateFiles.build(UpdateCapture(step=step, kind=kind, parts=reports, logged=logged), None)
            pq.write_table(files.table, work / f"{kind}.parquet")
            result["tables"][kind] = {"entry": {**files.entry.__dict__}}
            result["logged"][kind] = logged
        saved = work / "checkpoint"
        actor.save_checkpoint(str(saved / "actor"), global_step=step)
        if critic is not None:
            critic.save_checkpoint(str(saved / "critic"), global_step=step)
        recorded_after = Path(request["checkpoint"]) / f"global_step_{request['after']}"
        if request["after"] is not None and recorded_after.is_dir():
            result["parameters"] = {kind: _compare_parameters(saved / kind / MODEL_FILE, recorded_after / kind / MODEL_FILE) for kind in outputs}
        # the policy after the step, replayed and (from verl's checkpoint after the step) recorded
        after = {"replayed": RayPPOTrainer._compute_old_log_prob(trainer, batch)[0].batch["old_log_probs"].numpy()}
        if request["after"] is not None and recorded_after.is_dir():
            actor.load_checkpoint(str(recorded_after / "actor"), del_local_after_load=False)
            after["recorded"] = RayPPOTrainer._compute_old_log_prob(trainer, batch)[0].batch["old_log_probs"].numpy()
        np.savez(work / "after.npz", mask=batch.batch["response_mask"].numpy().astype(bool), **after)
        (work / "result.json").write_text(json.dumps(result, default=str))
    except ReplayError as error:
        print(f"verl-ext replay: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1]))
