"""Where a traced step sits in an asynchronous run, and the policy versions of its responses
(docs/definitions.md#policy-versions; trace format 11).

* :class:`StepPlace`: the step's place in verl's loop: verl's own step (``global_step``), which of its
  updates the trace step is (``substep``, of ``updates``: V1 ``separate_async``'s parameter_sync_step),
  the version its update starts from (``trainer_version``) and the run's mode;
* :class:`StepVersions`: per response of the prompt table, the versions of the weights that generated its
  first and last token, and its staleness, ``trainer_version − policy_version_min``.

A trace before format 11, or of a synchronous run, has none of them: :attr:`StepPlace.asynchronous` is
False there and every reader shows what it showed before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import pyarrow as pa

from verl_ext.offpolicy_metrics import staleness_metrics, versions
from verl_ext.steps.layout import locate

#: The mode of a run that overlapped nothing (RunRecord.mode's name).
SYNC = "sync"
#: Each asynchronous mode's setting that says how many updates share one weight sync, where it has one: V1's
#: modes run that many updates per step of verl's, fully async that many per weight version.
UPDATES_PER_SYNC = {"separate_async": "parameter_sync_step", "colocate_async": "parameter_sync_step", "fully_async": "trigger_parameter_sync_step"}


def mode_name(mode: Mapping[str, Any] | None) -> str | None:
    """The run record's mode's name; None where it records none (a trace before format 11)."""
    return None if not mode else mode.get("name")


def describe_mode(mode: Mapping[str, Any] | None) -> str | None:
    """``separate_async (parameter_sync_step=2)``: the mode and its settings; None for a synchronous run
    or one that does not say."""
    name = mode_name(mode)
    if name is None or name == SYNC:
        return None
    settings = ", ".join(f"{key}={value}" for key, value in mode.items() if key != "name" and value is not None)
    return f"{name} ({settings})" if settings else str(name)


def may_be_asynchronous(record) -> bool:
    """Whether a run record's steps may be of an asynchronous run: a trace of format 11 or later whose mode
    is not sync (a trace before format 11 is of a synchronous run; its steps say nothing of their place)."""
    return record.schema_version >= 11 and mode_name(record.mode) != SYNC


@dataclass(frozen=True)
class StepPlace:
    """One trace step's place in verl's loop (module docstring)."""

    step: int
    global_step: int | None
    substep: int | None
    trainer_version: int | None
    mode: Mapping[str, Any] | None

    @classmethod
    def of(cls, trace, step: int, entry=None) -> "StepPlace":
        """From the step's entry (``entry``: when read already) and the run record's mode."""
        entry = trace.step_record(step) if entry is None else entry
        return cls(step, entry.global_step, entry.substep, entry.trainer_version, trace.record.mode)

    @property
    def mode_name(self) -> str | None:
        return mode_name(self.mode)

    @property
    def asynchronous(self) -> bool:
        """The run overlapped generation and training (a mode other than sync), or, where the record names no
        mode, the step says where it sits (a sub-step, a trainer version)."""
        if self.mode_name is not None:
            return self.mode_name != SYNC
        return self.substep is not None or self.trainer_version is not None

    @property
    def verl_step(self) -> int:
        """verl's own step number (the trace's where the entry does not say)."""
        return self.step if self.global_step is None else int(self.global_step)

    @property
    def updates(self) -> int | None:
        """How many updates share the update's weight sync (:data:`UPDATES_PER_SYNC`), where the record says."""
        key = UPDATES_PER_SYNC.get(self.mode_name)
        value = (self.mode or {}).get(key) if key else None
        return int(value) if isinstance(value, int) else None

    def describe(self) -> str | None:
        """``verl step 2, update 2 of 2, trainer version 1`` (V1: the updates of verl's step; fully async: ``verl
        step 5, update 1 of the 2 of trainer version 2``); None for a step of a synchronous run."""
        if not self.asynchronous:
            return None
        parts = [f"verl step {self.verl_step}"]
        version = None if self.trainer_version is None else f"trainer version {self.trainer_version}"
        if self.substep is not None and self.mode_name == "fully_async":
            of = f" of the {self.updates}" if self.updates else ""
            return f"verl step {self.verl_step}, update {self.substep + 1}{of}" + (f" of {version}" if version else "")
        if self.substep is not None:
            parts.append(f"update {self.substep + 1}" + (f" of {self.updates}" if self.updates else ""))
        if version is not None:
            parts.append(version)
        return ", ".join(parts)

    def as_dict(self) -> dict[str, Any] | None:
        """For JSON and the view: global_step, substep, updates, trainer_version, mode (its name); None for a
        step of a synchronous run."""
        if not self.asynchronous:
            return None
        return {"global_step": self.verl_step, "substep": self.substep, "updates": self.updates,
                "trainer_version": self.trainer_version, "mode": self.mode_name}  # fmt: skip


@dataclass(frozen=True)
class StepVersions:
    """The policy versions of one step's responses, in the prompt table's order (``samples``)."""

    place: StepPlace
    samples: np.ndarray  # int64, the prompt table's sample ids
    version_min: np.ndarray  # float64, NaN where the rollout did not say
    version_max: np.ndarray

    @classmethod
    def read(cls, trace, step: int) -> "StepVersions":
        return cls.of(StepPlace.of(trace, step), trace.prompts(step))

    @classmethod
    def of(cls, place: StepPlace, prompts: pa.Table) -> "StepVersions":
        """From the step's prompt table (a table before format 11 has the columns, null)."""
        columns = [prompts.column(name).to_pylist() if name in prompts.column_names else [None] * prompts.num_rows
                   for name in ("policy_version_min", "policy_version_max")]  # fmt: skip
        samples = np.asarray(prompts.column("sample").to_numpy(), np.int64)
        return cls(place, samples, versions(columns[0]), versions(columns[1]))

    @property
    def known(self) -> bool:
        """Some response of the step has its version, in an asynchronous run's trace (a synchronous run's
        versions, where recorded, say nothing: its policy is the step's)."""
        return self.place.asynchronous and bool(np.isfinite(self.version_min).any())

    @property
    def staleness(self) -> np.ndarray | None:
        """Per response, trainer_version − policy_version_min (NaN where its version is unknown); None where
        the step's trainer version is unknown or the run is synchronous."""
        if self.place.trainer_version is None or not self.place.asynchronous:
            return None
        return float(self.place.trainer_version) - self.version_min

    def at(self, sample_ids: np.ndarray) -> dict[str, np.ndarray]:
        """version_min, version_max and staleness (NaN where unknown) of each of ``sample_ids``."""
        index, found = locate(self.samples, np.asarray(sample_ids, np.int64))
        staleness = self.staleness

        def pick(values: np.ndarray | None) -> np.ndarray:
            if values is None or not len(values):
                return np.full(len(index), np.nan)
            return np.where(found, values[index], np.nan)

        return {"version_min": pick(self.version_min), "version_max": pick(self.version_max), "staleness": pick(staleness)}

    def metrics(self) -> dict[str, float]:
        """:func:`verl_ext.offpolicy_metrics.staleness_metrics` of the step (the live metrics' numbers);
        empty where the run is synchronous."""
        if not self.place.asynchronous:
            return {}
        return staleness_metrics(self.place.trainer_version, self.version_min, self.version_max)
