"""The plugin's registrations of the HF-generate rollout into verl's two rollout registries (records of
:data:`verl_ext.touches.PLUGIN_TOUCHES`). They only name the classes: nothing heavy is imported until a
run asks for this rollout."""

from __future__ import annotations

from typing import Any

from verl_ext.hf_rollout import ROLLOUT_NAME

_SERVER_MODULE = "verl_ext.hf_rollout.server"


def register_rollout_adapter(rollout_base: Any) -> None:
    # Worker side: ActorRolloutRefWorker builds its rollout with get_rollout_class(name, "async"),
    # which imports the module named here only when a run asks for this rollout.
    rollout_base._ROLLOUT_REGISTRY[(ROLLOUT_NAME, "async")] = f"{_SERVER_MODULE}.HFServerAdapter"


def register_rollout_replica(replica: Any) -> None:
    # Trainer side: LLMServerManager starts servers through RolloutReplicaRegistry.get(name).
    def load_hf_replica():
        from verl_ext.hf_rollout.server import HFReplica

        return HFReplica

    replica.RolloutReplicaRegistry.register(ROLLOUT_NAME, load_hf_replica)
