"""The HF-generate rollout: verl's rollout served by transformers' ``generate``, on whatever device
torch reports (a CUDA GPU when there is one, else the CPU).

verl 0.9 registers only vLLM, SGLang and TensorRT-LLM rollouts. This one needs nothing but
transformers, so a GPU machine without vLLM can still run verl's trainer for a smoke test
(``actor_rollout_ref.rollout.name=hf_generate``), and the CPU backend runs on it. The plugin
registers it in every verl process (:mod:`verl_ext.hf_rollout.registration`, two records of
:data:`verl_ext.touches.PLUGIN_TOUCHES`); it needs nothing of the CPU backend, which a GPU run never
imports. The server, the replica and the adapter are in :mod:`verl_ext.hf_rollout.server`.

This module imports neither verl nor torch.
"""

from __future__ import annotations

#: ``actor_rollout_ref.rollout.name`` of this rollout.
ROLLOUT_NAME = "hf_generate"


def rollout_device(cuda_available: bool | None = None) -> str:
    """The device the rollout generates on: ``cuda`` when torch sees a CUDA device, else ``cpu``.

    ``cuda_available`` None asks torch. Inside a Ray actor torch sees the devices Ray left visible to
    it (:meth:`verl_ext.hf_rollout.server.HFReplica.launch_servers` gives the server its worker's)."""
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available()
    return "cuda" if cuda_available else "cpu"
