"""Test-only verl plugin (loaded with VERL_USE_EXTERNAL_MODULES in every process of a V1 run):
when the V1 trainer updates the actor, save what that update reads from TransferQueue.

This is the test's own copy of "the tensors the trainer actually used", taken at a different
moment and by different code than verl-ext's trace (which reads them right after the advantages
are computed). Files: $VERL_EXT_TEST_CAPTURE_DIR/step<N>.pt, or step<N>-<j>.pt for the j-th of the
parameter_sync_step > 1 updates of step N (0-based), with the samples' policy versions as their
TransferQueue tags say.

Covers no module by itself: tests/e2e/test_v1_trace.py holds verl_ext.trace's capture of the V1
trainer to it; it hooks verl through verl_ext.patching.
"""

from __future__ import annotations

import functools
import os

from verl_ext.patching import when_imported

FIELDS = [
    "response_mask", "responses", "rm_scores", "token_level_rewards", "values",
    "returns", "advantages", "old_log_probs", "ref_log_prob", "rollout_log_probs", "rollout_is_weights",
    "loss_mask",  # verl's rollout wrote it as the response mask before the rollout correction's rejection
]  # fmt: skip


def _capture_before_actor_update(trainer_base) -> None:
    original = trainer_base.PPOTrainer._update_actor

    @functools.wraps(original)
    def _update_actor(self, batch, metrics):
        import torch
        import transfer_queue as tq

        present = [name for name in FIELDS if batch.fields is None or name in batch.fields]  # a run without KL, a reference, a correction
        stored = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=present)
        tensors = {name: stored[name].to_padded_tensor(padding=0) for name in present}
        # each response's own tokens (the nested tensor's lengths): the response mask before verl's rejection
        tensors["response_length"] = torch.tensor([len(row) for row in stored["responses"].unbind()])
        versions = [(tag.get("min_global_steps"), tag.get("max_global_steps")) for tag in batch.tags]
        directory = os.environ["VERL_EXT_TEST_CAPTURE_DIR"]
        name = f"step{self.global_steps}" + (f"-{self.local_trigger_step}" if self.parameter_sync_step > 1 else "")
        torch.save({"keys": list(batch.keys), "versions": versions, **tensors}, os.path.join(directory, f"{name}.pt"))
        return original(self, batch, metrics)

    trainer_base.PPOTrainer._update_actor = _update_actor


if os.environ.get("VERL_EXT_TEST_CAPTURE_DIR"):
    when_imported("verl.trainer.ppo.v1.trainer_base", _capture_before_actor_update)
