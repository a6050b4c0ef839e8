"""verl's vLLM replica for the in-process runner (:mod:`verl_ext.cpu.in_process`): verl's own server
(``vLLMHttpServer``, a Ray actor, which needs Ray) behind an in-process trainer. Imported only by a
run whose rollout is vLLM: it imports verl's vLLM server module, and with it vLLM."""

from __future__ import annotations

import verl_ext.cpu

# verl's vLLM server module reads vLLM's version as the distribution "vllm", which the CPU backend answers
# for vLLM's CPU build (verl_ext.touches): importing this module never activates the backend.
if not verl_ext.cpu.is_active():
    raise ImportError(
        "verl_ext.cpu.vllm_replica serves verl's vLLM rollout on the CPU backend, which is not active: call "
        "verl_ext.cpu.activate() (or set VERL_EXT_CPU=1 and import verl) before importing this module"
    )

import ray  # noqa: E402
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMReplica  # noqa: E402

from verl_ext.cpu.local_actor import ThisNodeWorker  # noqa: E402


class LocalVLLMReplica(vLLMReplica):
    """verl's vLLM replica, its workers the in-process runner's (no Ray actors): verl's
    ``launch_servers`` asks each worker for its node and device, which here are this process' node and
    device 0; everything else is verl's."""

    async def launch_servers(self):
        node = _node_for_the_server()
        self.workers = [ThisNodeWorker(node) for _ in self.workers]
        await super().launch_servers()


def _node_for_the_server() -> str:
    """This process' node when it has CPUs for the server actor, else another live node of this machine
    that has (a cluster whose head declares none); the server must share this machine's memory, through
    which verl's weight sync passes on a CPU."""
    here = ray.get_runtime_context().get_node_id()
    address = ray.util.get_node_ip_address()
    nodes = [n for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == address and n["Resources"].get("CPU", 0) > 0]
    ids = [n["NodeID"] for n in nodes]
    if here in ids or not ids:
        return here
    return ids[0]
