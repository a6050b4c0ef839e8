"""The HF-generate rollout's classes: verl's rollout served by transformers' ``generate`` on the
device torch reports (:func:`verl_ext.hf_rollout.rollout_device`).

They plug into the two registries verl's vLLM, SGLang and TensorRT-LLM rollouts use, under
:data:`verl_ext.hf_rollout.ROLLOUT_NAME` (the plugin's registrations, :mod:`verl_ext.hf_rollout`):

* ``HFGenerationServer``: the token-in/token-out server verl's ``LLMServerClient`` calls
  (``generate(request_id, prompt_ids, sampling_params) -> TokenOutput``). It batches the requests
  that arrive together into one ``generate`` call (whatever number of tokens each may get, as the
  turns of a multi-turn rollout differ; each ends at EOS or at one of verl's ``stop_token_ids``)
  and reports the weights version in
  ``extra_fields["global_steps"]``, which verl's V1 trainer requires. Each request samples from its
  own random stream, and the model runs in float64, so what it gets does not depend on which
  requests share its batch on a CPU (in float32 the batch's size and padding move a log-prob by up to
  4e-6, enough to flip a sampled token now and then: two 25-step runs with one seed once parted
  at step 2; on a GPU it runs in float32, for a smoke test); under
  verl's ``rollout.full_determinism=True`` (request ids ``det-<index>``) the stream is a function
  of the rollout seed, the request id, the weights version and the round's name alone ("training",
  or "validation" when the in-process trainer says so), and a run is reproducible.
* ``HFReplica`` (``RolloutReplicaRegistry``): starts one server per replica; on Ray a named actor.
* ``HFServerAdapter`` (``_ROLLOUT_REGISTRY``): the rollout object inside verl's hybrid
  ``ActorRolloutRefWorker``; it forwards the trainer's weights to its replica's server.

The CPU backend's in-process runner (:mod:`verl_ext.cpu.in_process`) uses the same classes without Ray: it
registers a local server handle with :func:`register_local_server`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from dataclasses import dataclass
from typing import Any, Generator

import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica, TokenOutput

from verl_ext.hf_rollout import rollout_device

logger = logging.getLogger(__name__)

SERVER_NAME_PREFIX = "verl_ext_hf_server_"

#: Requests that arrive within this quiet period of each other are generated as one batch.
BATCH_QUIET_SECONDS = 0.01
BATCH_MAX_WAIT_SECONDS = 0.2

#: replica_rank -> server handle, for servers living in this process (the in-process runner).
_LOCAL_SERVERS: dict[int, Any] = {}


def register_local_server(replica_rank: int, handle: Any) -> None:
    """Make an in-process server reachable by the adapters of this process (no Ray)."""
    _LOCAL_SERVERS[replica_rank] = handle


def server_actor_name(replica_rank: int) -> str:
    return f"{SERVER_NAME_PREFIX}{replica_rank}"


def locate_server(replica_rank: int) -> Any:
    """The handle of replica ``replica_rank``'s server: in-process if registered, else a Ray named actor."""
    if replica_rank in _LOCAL_SERVERS:
        return _LOCAL_SERVERS[replica_rank]
    import ray

    return ray.get_actor(server_actor_name(replica_rank))


@dataclass(frozen=True)
class _Sampling:
    """The sampling settings one ``generate`` call can share (requests are grouped by them). How
    many tokens a request may get is its own (:func:`_max_new_tokens`): the call generates the
    group's most, and each row is cut at its own (a row's tokens do not depend on how long the
    others run: its noise stream advances one draw a step)."""

    greedy: bool
    temperature: float
    top_p: float
    top_k: int
    logprobs: bool
    #: ids that end a response besides the model's EOS (verl's ``stop_token_ids``, set by some tool parsers)
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_request(cls, sampling_params: dict[str, Any]) -> "_Sampling":
        temperature = float(sampling_params.get("temperature", 1.0))
        return cls(
            greedy=temperature == 0.0,
            temperature=temperature,
            top_p=float(sampling_params.get("top_p", 1.0)),
            top_k=int(sampling_params.get("top_k", -1)),
            logprobs=bool(sampling_params.get("logprobs", False)),
            stop_token_ids=tuple(int(i) for i in sampling_params.get("stop_token_ids") or ()),
        )


def _max_new_tokens(sampling_params: dict[str, Any], room: int) -> int:
    """The most new tokens a request gets: what it asks (``max_tokens``), within ``room`` (what the
    response length and the model length leave after its prompt)."""
    requested = sampling_params.get("max_tokens", sampling_params.get("max_new_tokens"))
    return room if requested is None else max(1, min(int(requested), room))


class HFGenerationServer:
    """Generates with a copy of the policy on :func:`rollout_device`, float64 on a CPU (why: the
    module's docstring), float32 on a GPU; weights arrive from the trainer each step."""

    def __init__(self, model_path: str, rollout_config, replica_rank: int = 0):
        from transformers import AutoModelForCausalLM

        self.replica_rank = replica_rank
        self.config = rollout_config
        self.device = torch.device(rollout_device())
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.model = self.model.to(self.device).eval()
        self._parameter_names = {name for name, _ in self.model.named_parameters()}
        generation_config = self.model.generation_config
        self.eos_token_id = generation_config.eos_token_id
        self.pad_token_id = generation_config.pad_token_id if generation_config.pad_token_id is not None else 0
        self.max_model_len = rollout_config.max_model_len or (
            rollout_config.prompt_length + rollout_config.response_length
        )
        # Private random streams: sampling never touches the process' global torch RNG, which the
        # in-process runner shares with training.
        self._seed = rollout_config.seed + replica_rank
        self._generator = torch.Generator().manual_seed(self._seed)
        self._stream = "training"
        self._repeats: dict[str, int] = {}  # seed/stream/version/request id -> times seen
        self.global_steps: int | None = None
        self._pending: list[tuple[list[int], _Sampling, int, int, asyncio.Future]] = []  # prompt, sampling, most tokens, seed, future
        self._drainer: asyncio.Task | None = None

    def compute_dtype(self) -> str:
        """The dtype the model generates in (torch's name: "float64" on a CPU), for the trace's run record."""
        return str(self.model.dtype).removeprefix("torch.")

    # ---- token-in, token-out generation (called by verl's LLMServerClient) ----

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any], **unused_multimodal
    ) -> TokenOutput:
        room = min(self.config.response_length, self.max_model_len - len(prompt_ids))
        if room < 1:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens leaves no room within {self.max_model_len}")
        future = asyncio.get_running_loop().create_future()
        request = (list(prompt_ids), _Sampling.from_request(sampling_params), _max_new_tokens(sampling_params, room))
        self._pending.append((*request, self._request_seed(request_id), future))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        token_ids, log_probs, weights_version = await future
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed",
            # the version of the weights that generated it, read when it was generated: an update may
            # land between the generation and this coroutine's turn (an asynchronous trainer's sync)
            extra_fields={"global_steps": weights_version},
        )

    async def _drain(self) -> None:
        waited = 0.0
        while True:  # wait for a quiet period so concurrent requests share one generate() call
            seen = len(self._pending)
            await asyncio.sleep(BATCH_QUIET_SECONDS)
            waited += BATCH_QUIET_SECONDS
            if len(self._pending) == seen or waited >= BATCH_MAX_WAIT_SECONDS:
                break
        while self._pending:
            batch, self._pending = self._pending, []
            groups: dict[_Sampling, list[tuple[list[int], int, int, asyncio.Future]]] = {}
            for prompt, sampling, most, seed, future in batch:
                groups.setdefault(sampling, []).append((prompt, most, seed, future))
            for sampling, requests in groups.items():
                prompts, most, seeds, futures = (list(column) for column in zip(*requests))
                weights_version = self.global_steps  # update_weights cannot run inside this synchronous call
                try:
                    results = self._generate_batch(prompts, sampling, seeds, most)
                except Exception as exc:  # fail the waiting requests, not the server
                    for future in futures:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for future, result in zip(futures, results, strict=True):
                    if not future.done():  # a request cancelled by its caller
                        future.set_result((*result, weights_version))

    def use_stream(self, name: str) -> None:
        """Name the rounds that follow ("training", "validation"); a deterministic request's stream
        depends on the name, so validating does not change what training samples."""
        self._stream = name

    def _request_seed(self, request_id: str) -> int:
        """The seed of a request's random stream. For a deterministic id (``det-<index>``, repeated
        every round): from the rollout seed, the stream name, the weights version, the id and how
        often that combination was seen before; else drawn from the server's private stream."""
        if not str(request_id).startswith("det-"):
            return int(torch.randint(2**62, (1,), generator=self._generator))
        key = f"{self._seed}/{self._stream}/{self.global_steps}/{request_id}"
        repeat = self._repeats[key] = self._repeats.get(key, -1) + 1
        digest = hashlib.sha256(f"{key}/{repeat}".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 2

    @torch.no_grad()
    def _generate_batch(self, prompts: list[list[int]], sampling: _Sampling, seeds: list[int], most: list[int]):
        """Each prompt's response: sampled (or greedy), at most ``most[i]`` tokens, through the first
        EOS or stop token; with its log-probs when the sampling asks for them."""
        width = max(len(p) for p in prompts)
        eos = self.eos_token_id if isinstance(self.eos_token_id, list) else [i for i in (self.eos_token_id,) if i is not None]
        stops = [*eos, *(i for i in sampling.stop_token_ids if i not in eos)]
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation requires
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention_mask[row, width - len(prompt) :] = 1
        output = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            max_new_tokens=max(most),
            eos_token_id=stops or None,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_logits=sampling.logprobs,
            do_sample=False,  # greedy over the processed scores: with Gumbel noise added, an exact sample
            logits_processor=None if sampling.greedy else [_PerRowSampling(sampling, seeds)],
        )
        generated = output.sequences[:, width:]
        if sampling.logprobs:
            logits = torch.stack(output.logits, dim=1) / (sampling.temperature or 1.0)
            token_log_probs = torch.log_softmax(logits, dim=-1).gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        results = []
        for row in range(len(prompts)):
            tokens = generated[row, : most[row]].tolist()
            length = _length_through_eos(tokens, stops)
            log_probs = token_log_probs[row, :length].tolist() if sampling.logprobs else None
            results.append((tokens[:length], log_probs))
        return results

    # ---- weights (called by HFServerAdapter inside the trainer's worker) ----

    async def update_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> None:
        missing, unexpected = self.model.load_state_dict(state_dict, strict=False)
        if unexpected or self._parameter_names.intersection(missing):  # buffers (rotary) are not sent
            raise RuntimeError(f"weights do not match the rollout model: missing={missing}, unexpected={unexpected}")
        self.global_steps = global_steps

    # ---- lifecycle calls verl makes on every rollout server: nothing to free or resume on CPU ----

    async def wake_up(self, *args, **kwargs) -> None:
        pass

    async def sleep(self, *args, **kwargs) -> None:
        pass

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        pass

    async def resume_generation(self) -> None:
        pass

    async def clear_kv_cache(self) -> None:
        pass

    async def release_kv_cache(self) -> None:
        pass

    async def resume_kv_cache(self) -> None:
        pass

    async def start_profile(self, **kwargs) -> None:
        pass

    async def stop_profile(self) -> None:
        pass


class _PerRowSampling:
    """A logits processor that turns greedy decoding into sampling, one random stream per row.

    Gumbel-max: argmax(log softmax(z) + g) with g ~ Gumbel(0, 1) i.i.d. is a sample of softmax(z).
    Each row's noise comes from its own generator, so its sample depends on its seed alone.
    ``z`` is the scores divided by the temperature, then top-k / top-p filtered (HF's warpers).
    """

    def __init__(self, sampling: _Sampling, seeds: list[int]):
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.warpers = [TemperatureLogitsWarper(sampling.temperature)]
        if sampling.top_k > 0:
            self.warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(sampling.top_p))
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        # drawn on the CPU, where each row's generator lives, whatever device the scores are on
        uniform = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64) for g in self.generators])
        uniform = uniform.to(scores.device)
        gumbel = -torch.log(-torch.log(uniform.clamp_min(1e-300)))
        return torch.log_softmax(scores.double(), dim=-1) + gumbel


def _length_through_eos(tokens: list[int], eos_token_id) -> int:
    """Length of the response up to and including the first EOS (verl keeps EOS in the response)."""
    eos_ids = set(eos_token_id if isinstance(eos_token_id, list) else [eos_token_id])
    for position, token in enumerate(tokens):
        if token in eos_ids:
            return position + 1
    return len(tokens)


class HFReplica(RolloutReplica):
    """One generation server per replica; on Ray a named actor the workers' adapters look up."""

    async def launch_servers(self):
        import ray

        options = {"name": server_actor_name(self.replica_rank), "num_cpus": 0}  # the name locate_server looks up
        options.update(await self._beside_first_worker())
        server = ray.remote(HFGenerationServer).options(**options).remote(self.model_path(), self.config, self.replica_rank)
        await server.wake_up.remote()  # wait until the model is loaded
        self._attach(server)

    async def _beside_first_worker(self) -> dict[str, Any]:
        """Ray options that put the server on its replica's first GPU, as verl's vLLM replica puts its
        servers (``vLLMReplica.launch_servers``): on that worker's node, with that worker's device
        visible and Ray told not to hide it (an actor that reserves no GPU sees none). On a CPU
        platform, or without workers (a standalone replica), none: the server runs where Ray puts it."""
        from verl.utils.device import get_device_name, get_resource_name
        from verl.plugin.platform import get_platform

        if get_device_name() == "cpu" or not self.workers:
            return {}
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node_id, device = await self.workers[0].__ray_call__.remote(
            lambda worker: (
                ray.get_runtime_context().get_node_id(),
                ray.get_runtime_context().get_accelerator_ids()[get_resource_name()][0],
            )
        )
        visible = {"cuda": "CUDA_VISIBLE_DEVICES"}.get(get_device_name())
        env_vars = {**{name: "1" for name in get_platform().ray_noset_envvars()}, **({visible: str(device)} if visible else {})}
        return {
            "scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
            "runtime_env": {"env_vars": env_vars},
        }

    def model_path(self) -> str:
        from verl.utils.fs import copy_to_local

        return copy_to_local(self.model_config.path)

    def _attach(self, server: Any) -> None:
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"hf-generate/replica-{self.replica_rank}"  # a label: there is no HTTP endpoint


class HFServerAdapter(BaseRollout):
    """The rollout inside verl's hybrid worker: forwards each weight update to its replica's server."""

    def __init__(self, config, model_config, device_mesh, *args, replica_rank: int = -1, **kwargs):
        super().__init__(config, model_config, device_mesh)
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.owns_server = rank % rollout_world_size == 0  # one rank per replica sends the weights

    async def update_weights(
        self,
        weights: Generator[tuple[str, torch.Tensor], None, None],
        wire_format: str = "named_tensors",
        global_steps: int | None = None,
        **kwargs,
    ):
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf_generate rollout receives full tensors only, not {wire_format!r}")
        state_dict = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
        if self.owns_server:
            await locate_server(self.replica_rank).update_weights.remote(state_dict, global_steps)

    async def resume(self, tags: list[str]):
        pass

    async def release(self):
        pass
