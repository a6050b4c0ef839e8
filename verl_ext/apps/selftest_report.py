"""What ``verl-ext selftest`` prints: what ran (read from the composed config and the run record),
each run's verdict in one line, and a failed run's cause in one line from its log.

Pure functions of data (a config as nested dicts, a check report, a log's text): no run needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

#: The longest diagnosis line: long enough for verl's config errors, short enough for a terminal.
LINE_WIDTH = 240


@dataclass(frozen=True)
class RunOutcome:
    """One selftest run: ``verdict`` is ``PASS``, ``FAIL`` (an identity is violated), ``INCOMPLETE``
    (an identity that applies could not be evaluated) or ``ERROR`` (the run itself failed); ``line``
    says why when it is not ``PASS``."""

    name: str
    verdict: str
    seconds: float
    line: str = ""
    log: str | None = None

    @property
    def passed(self) -> bool:
        return self.verdict == "PASS"


# --------------------------------------------------------------------------- what ran


def _get(config: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node or node[part] is None:
            return default
        node = node[part]
    return node


def what_ran(config: Mapping[str, Any], device: str, versions: Mapping[str, str]) -> dict[str, str]:
    """The settings of a run that decide whether verl-ext works on it, from its composed trainer
    config (plain dicts: ``OmegaConf.to_container``): ``device`` the accelerator the trainer sees
    ("cpu", "cuda"), ``versions`` verl's and verl-ext's (the run record's when there is one)."""
    actor = "actor_rollout_ref.actor"
    nodes, per_node = int(_get(config, "trainer.nnodes", 1)), int(_get(config, "trainer.n_gpus_per_node", 1))
    world = nodes * per_node
    strategy = str(_get(config, f"{actor}.strategy", "fsdp"))
    if strategy == "megatron":
        tensor, pipeline = (int(_get(config, f"{actor}.megatron.{k}_model_parallel_size", 1)) for k in ("tensor", "pipeline"))
        sequence, model_ranks = 1, tensor * pipeline
        actor_ranks = f"tensor {tensor}, pipeline {pipeline}"
    else:
        sequence = int(_get(config, f"{actor}.ulysses_sequence_parallel_size", 1))
        model_ranks = sequence
        actor_ranks = f"sequence (Ulysses) {sequence}"
    param = _get(config, f"{actor}.fsdp_config.mixed_precision.param_dtype") or _get(config, f"{actor}.megatron.dtype")
    reduce = _get(config, f"{actor}.fsdp_config.mixed_precision.reduce_dtype")
    rollout = "actor_rollout_ref.rollout"
    packed = bool(_get(config, "actor_rollout_ref.model.use_remove_padding", False))
    dynamic = bool(_get(config, f"{actor}.use_dynamic_bsz", False))
    return {
        "device": f"{device} × {world} ({nodes} node{'s' if nodes != 1 else ''} × {per_node})",
        "versions": f"verl {versions.get('verl', '?')}, verl-ext {versions.get('verl_ext', '?')}",
        "precision": f"{strategy} params {param or 'bf16 (verl default)'}, reductions {reduce or 'fp32 (verl default)'}; "
        f"rollout {_rollout_dtype(config, device)}",
        "rollout": f"{_get(config, f'{rollout}.name', '?')} ({_get(config, f'{rollout}.mode', 'async')}; "
        f"tensor {_get(config, f'{rollout}.tensor_model_parallel_size', 1)}, "
        f"data {_get(config, f'{rollout}.data_parallel_size', 1)}, "
        f"pipeline {_get(config, f'{rollout}.pipeline_model_parallel_size', 1)})",
        "trainer": ("V1 PPOTrainer" if _get(config, "trainer.use_v1", False) else "legacy RayPPOTrainer")
        + (", hybrid engine" if _get(config, "actor_rollout_ref.hybrid_engine", True) else ", separate rollout"),
        "ranks": f"data-parallel {max(1, world // model_ranks)}; actor {actor_ranks}",
        "batches": ("packed (use_remove_padding)" if packed else "padded")
        + (", micro-batches by token count (use_dynamic_bsz)" if dynamic else ", fixed micro-batches"),
    }


def _rollout_dtype(config: Mapping[str, Any], device: str) -> str:
    """What the rollout generates in: the HF-generate rollout its own (verl_ext.hf_rollout.server), others the config's."""
    from verl_ext.hf_rollout import ROLLOUT_NAME

    if _get(config, "actor_rollout_ref.rollout.name") == ROLLOUT_NAME:
        return "float64" if device == "cpu" else "float32"
    return str(_get(config, "actor_rollout_ref.rollout.dtype", "?"))


# --------------------------------------------------------------------------- a run's verdict


def first_failure(report) -> str:
    """One line for a check report (:class:`verl_ext.check.run.CheckReport`) that did not pass:
    the first violated identity and where (step, sample, token), else what was not evaluated."""
    for result in report.identities:
        if result.status == "fail":
            where = str(result.first) if result.first is not None else (result.notes[0] if result.notes else "violated")
            return f"{result.identity}: {where}"
    for reason, identities in report.not_checked.items():
        return f"not evaluated here: {', '.join(identities)} ({reason})"
    return ""


def verdict_of(report) -> tuple[str, str]:
    """(``PASS``/``FAIL``/``INCOMPLETE``, the line of :func:`first_failure`) of a check report."""
    return {"pass": "PASS", "fail": "FAIL", "incomplete": "INCOMPLETE"}[report.verdict], first_failure(report)


# --------------------------------------------------------------------------- a failed run in one line

_HYDRA = re.compile(r"(Could not override|Error merging override|Error parsing override|Could not append|Key '.+' is not in struct|Could not load '.+')")
_EXCEPTION = re.compile(r"^\s*(?:\w+\.)*(?P<name>\w*(?:Error|Exception|Exit))(?:\((?P<inner>\w+)\))?: (?P<message>.*\S)")
#: What Ray puts before a line of an actor's output: "(TaskRunner pid=123) ", "(WorkerDict pid=9, ip=10.0.0.1) "
_RAY_PREFIX = re.compile(r"^\(\w+ pid=\d+(?:, ip=[\d.]+)?\)\s?")
#: Wrappers that only say where the real error happened (its own line follows in the log).
_WRAPPERS = ("RayTaskError", "RayActorError", "ActorDiedError")


def diagnose_log(text: str) -> str:
    """The cause of a failed trainer run in one line, from its output: hydra's complaint about an
    override, else the error verl raised (the innermost one when Ray wrapped it), else the last line."""
    lines = [_RAY_PREFIX.sub("", line).rstrip() for line in text.splitlines() if line.strip()]
    for index, line in enumerate(lines):
        if _HYDRA.search(line):
            following = lines[index + 1].strip() if index + 1 < len(lines) and not _EXCEPTION.match(lines[index + 1]) else ""
            return _clip(" ".join(part for part in (line.strip(), following) if part))
    errors = [match for match in map(_EXCEPTION.match, lines) if match]
    real = [m for m in errors if m.group("name") not in _WRAPPERS and not m.group("message").startswith("ray::")]
    chosen = (real or errors)[-1] if errors else None
    if chosen is None:
        return _clip(lines[-1].strip()) if lines else "the trainer printed nothing"
    return _clip(f"{chosen.group('inner') or chosen.group('name')}: {chosen.group('message')}")


def _clip(line: str) -> str:
    return line if len(line) <= LINE_WIDTH else line[: LINE_WIDTH - 1] + "…"


# --------------------------------------------------------------------------- the screen


def format_screen(setting: Mapping[str, str], overrides: list[str], outcomes: list[RunOutcome], seconds: float, output_dir: str) -> str:
    """The one screen ``verl-ext selftest`` prints."""
    width = max(map(len, [*setting, "overrides"]))
    lines = ["what ran:"]
    lines += [f"  {key:<{width}}  {value}" for key, value in setting.items()]
    lines.append(f"  {'overrides':<{width}}  {' '.join(overrides) if overrides else '(none)'}")
    lines.append("")
    name_width = max(len(o.name) for o in outcomes)
    for outcome in outcomes:
        line = f"  {outcome.name:<{name_width}}  {outcome.verdict:<10} {outcome.seconds:5.0f} s"
        if not outcome.passed:
            line += f"  {outcome.line}"
            if outcome.log:
                line += f"  (log: {outcome.log})"
        lines.append(line)
    passed = all(o.passed for o in outcomes)
    lines.append("")
    lines.append(f"{'PASS' if passed else 'FAIL'}: selftest in {seconds:.0f} s; outputs in {output_dir}")
    return "\n".join(lines)
