"""Test-only verl plugin (VERL_USE_EXTERNAL_MODULES=tests.e2e.nonfinite_probe): at step
$VERL_EXT_TEST_NAN_STEP, a NaN in the critic's values at sample 3, its first valid token from
token 1 on (as a broken critic would give), and a record of which steps updated; in the legacy
trainer (the values verl's _compute_values returns) and in the V1 trainer (the values its
_compute_advantage read from TransferQueue, as handed to compute_advantage_for_multi_trajectories).

Files in $VERL_EXT_TEST_NAN_DIR: ``injected.json`` (step, sample, token, uid) and ``updates.txt``
(one "<step> critic|actor" line per update that ran).

Covers no module by itself: it feeds tests/e2e/test_nonfinite_run.py's check of verl_ext.nonfinite,
hooking verl through verl_ext.patching.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from verl_ext.patching import when_imported


def _directory() -> Path:
    return Path(os.environ["VERL_EXT_TEST_NAN_DIR"])


def _nan_step() -> int:
    return int(os.environ["VERL_EXT_TEST_NAN_STEP"])


def _inject(values, batch, step: int) -> None:
    """NaN in ``values`` (B, T) at sample 3 of ``batch``, its first valid token after token 0."""
    token = int(batch.batch["response_mask"][3, 1:].nonzero()[0]) + 1
    values[3, token] = float("nan")
    uid = str(batch.non_tensor_batch["uid"][3])
    (_directory() / "injected.json").write_text(json.dumps({"step": step, "sample": 3, "token": token, "uid": uid}))


def _record_updates(trainer_class) -> None:
    for name in ("critic", "actor"):
        original = getattr(trainer_class, f"_update_{name}")

        @functools.wraps(original)
        def update(self, *args, _original=original, _name=name, **kwargs):
            with open(_directory() / "updates.txt", "a") as log:
                log.write(f"{self.global_steps} {_name}\n")
            return _original(self, *args, **kwargs)

        setattr(trainer_class, f"_update_{name}", update)


def _patch_legacy(ray_trainer) -> None:
    trainer = ray_trainer.RayPPOTrainer
    compute_values = trainer._compute_values

    @functools.wraps(compute_values)
    def _compute_values(self, batch):
        values = compute_values(self, batch)
        if self.global_steps == _nan_step():
            _inject(values.batch["values"], batch, self.global_steps)
        return values

    trainer._compute_values = _compute_values
    _record_updates(trainer)


def _patch_v1(trainer_base) -> None:
    compute = trainer_base.compute_advantage_for_multi_trajectories  # looked up by _compute_advantage at call time
    steps = {}

    @functools.wraps(compute)
    def compute_advantage_for_multi_trajectories(data, *args, **kwargs):
        if steps.get("now") == _nan_step():
            _inject(data.batch["values"], data, steps["now"])
        return compute(data, *args, **kwargs)

    compute_advantage = trainer_base.PPOTrainer._compute_advantage

    @functools.wraps(compute_advantage)
    def _compute_advantage(self, *args, **kwargs):
        steps["now"] = self.global_steps
        return compute_advantage(self, *args, **kwargs)

    trainer_base.compute_advantage_for_multi_trajectories = compute_advantage_for_multi_trajectories
    trainer_base.PPOTrainer._compute_advantage = _compute_advantage
    _record_updates(trainer_base.PPOTrainer)


if os.environ.get("VERL_EXT_TEST_NAN_DIR"):
    when_imported("verl.trainer.ppo.ray_trainer", _patch_legacy)
    when_imported("verl.trainer.ppo.v1.trainer_base", _patch_v1)
