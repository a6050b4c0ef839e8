"""verl's update path around a stand-in model, for tests/integration/test_update_hook.py and
benchmarks/bench_update_payload.py.

Everything from the trainer's batch to what the driver keeps is verl's own code: the trainer's
``left_right_2_no_padding``, the dispatch split (``_split_args_kwargs_data_proto``),
``TrainingWorker.train_mini_batch`` / ``train_batch`` / ``_postprocess_output`` (the all-gather of the
metrics), the FSDP engine's ``forward_backward_batch`` and ``forward_step``, the loss functions, and the
driver's collect (``collect_nd_compute_dataproto``, which keeps the first output). Only the model is
replaced: its forward returns the outputs the batch carries (:data:`MODEL_OUTPUTS`), in their dtype,
as verl's bf16 model would. Ranks are processes of a gloo group (:func:`run_ranks`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import tempfile
from dataclasses import dataclass
from types import MethodType, SimpleNamespace
from typing import Any, Callable

import torch

#: batch key of a stand-in model output (per token of the whole sequence, nested like input_ids) -> its name
MODEL_OUTPUTS = {"standin_log_probs": "log_probs", "standin_entropy": "entropy", "standin_values": "values"}


def trainer_batch(samples: int, prompt_length: int, response_length: int, seed: int = 0, dtype=torch.bfloat16):
    """The batch a trainer hands the update (after ``left_right_2_no_padding``), row key included, with
    the stand-in model's outputs in ``dtype`` (log-probs stay float32, as verl's fused backend returns
    them; entropy and values in the model's dtype)."""
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    from verl_ext.trace.batch_keys import ROW_KEY

    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(1, prompt_length + 1, (samples,), generator=generator)
    response_lengths = torch.randint(1, response_length + 1, (samples,), generator=generator)
    prompt_mask = torch.arange(prompt_length).flip(0)[None, :] < prompt_lengths[:, None]  # left-padded
    response_mask = torch.arange(response_length)[None, :] < response_lengths[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    input_ids = torch.randint(3, 100, attention_mask.shape, generator=generator) * attention_mask
    batch = TensorDict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
            "prompts": input_ids[:, :prompt_length],
            "responses": input_ids[:, prompt_length:],
            "response_mask": response_mask.long(),
            "old_log_probs": -torch.rand(samples, response_length, generator=generator) * response_mask,
            "advantages": torch.randn(samples, response_length, generator=generator) * response_mask,
            "values": torch.randn(samples, response_length, generator=generator).to(dtype) * response_mask,
            "returns": torch.randn(samples, response_length, generator=generator) * response_mask,
            ROW_KEY: torch.arange(samples),
        },
        batch_size=[samples],
    )
    batch = left_right_2_no_padding(batch)
    offsets = batch["input_ids"].offsets()
    tokens = int(offsets[-1])
    outputs = {
        "standin_log_probs": -torch.rand(tokens, generator=generator),  # float32, as the fused backend's
        "standin_entropy": torch.rand(tokens, generator=generator).to(dtype),
        "standin_values": torch.randn(tokens, generator=generator).to(dtype),
    }
    for key, values in outputs.items():
        batch[key] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
    return batch


class StandInEngine:
    """verl's FSDP engine code with a stand-in forward (:data:`MODEL_OUTPUTS` of the micro-batch)."""

    def __init__(self, ulysses_device_mesh=None, ulysses_sequence_parallel_size: int = 1):
        from verl.workers.engine.base import BaseEngine
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead

        verls = {
            "train_batch": BaseEngine.train_batch,
            "forward_backward_batch": FSDPEngine.forward_backward_batch,
            "forward_step": FSDPEngineWithLMHead.forward_step,
            "is_mp_src_rank_with_outputs": FSDPEngine.is_mp_src_rank_with_outputs,
            "get_data_parallel_rank": FSDPEngine.get_data_parallel_rank,
            "get_data_parallel_size": FSDPEngine.get_data_parallel_size,
            "get_data_parallel_group": FSDPEngine.get_data_parallel_group,
        }
        for name, function in verls.items():
            setattr(self, name, MethodType(function, self))
        self.ulysses_device_mesh = ulysses_device_mesh
        self.ulysses_sequence_parallel_size = ulysses_sequence_parallel_size
        self.engine_config = SimpleNamespace(use_no_sync_for_gradient_accumulation=False)
        self._autocast_dtype = torch.float32  # the outputs carry their own dtype
        self.module = lambda **inputs: None

    def prepare_model_inputs(self, micro_batch):
        return {}, {}

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        return {
            name: micro_batch[key].clone().requires_grad_(True)  # a leaf, so that verl's backward runs
            for key, name in MODEL_OUTPUTS.items()
            if key in micro_batch.keys()
        }

    def _gradient_sync_context(self, *, is_last_micro_batch: bool):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def train_mode(self, **kwargs):
        yield

    def optimizer_zero_grad(self):
        pass

    def optimizer_step(self):
        return 1.0

    def lr_scheduler_step(self):
        return 1e-6


class _Profiler:
    rank = 0

    def step(self):
        pass

    def check_enable(self):
        return False


def training_worker(kind: str, micro_batch_size: int, engine: StandInEngine | None = None):
    """verl's ``TrainingWorker`` (its methods as installed, verl-ext's patch included) over a
    :class:`StandInEngine`, with verl's loss function of ``kind`` ("actor" | "critic")."""
    from verl.workers import engine_workers
    from verl.workers.config import FSDPActorConfig, FSDPCriticConfig
    from verl.workers.utils import losses

    worker = engine_workers.TrainingWorker.__new__(engine_workers.TrainingWorker)
    worker.engine = engine or StandInEngine()
    worker.engine_config = SimpleNamespace(
        forward_only=False, use_dynamic_bsz=False, max_token_len_per_gpu=None,
        micro_batch_size_per_gpu=micro_batch_size, use_fused_kernels=False,
    )  # fmt: skip
    worker.model_config = {"use_remove_padding": False}
    worker.device_name = "cpu"
    worker.flops_counter = None
    worker.profiler = _Profiler()
    if kind == "actor":
        config = FSDPActorConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1, entropy_coeff=0.01)
        worker.loss_fn = functools.partial(losses.ppo_loss, config=config)  # the patched one, as verl binds it
    else:
        config = FSDPCriticConfig(strategy="fsdp2", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1)
        worker.loss_fn = functools.partial(losses.value_loss, config=config)
    return worker


def update_arguments(batch, mini_batch_size: int, epochs: int):
    """What the trainer assigns to the batch before ``train_mini_batch`` (ray_trainer.py:1340-1368)."""
    from verl.utils import tensordict_utils as tu

    tu.assign_non_tensor(
        batch, calculate_entropy=True, global_batch_size=mini_batch_size, mini_batch_size=mini_batch_size,
        epochs=epochs, seed=0, dataloader_kwargs={"shuffle": False}, compute_loss=True,
    )  # fmt: skip
    return batch


@dataclass(frozen=True)
class UpdateJob:
    """One data-parallel rank's ``train_mini_batch`` of each update (``kinds``), on its share of the
    trainer's batch as verl's dispatch splits it; called as ``job(rank, world_size)`` by :func:`run_ranks`.
    Answers {(kind, patched): the rank's output}, what the driver fetches from it. ``patched`` False:
    verl's method without verl-ext's patch of it (the loss functions still report, as before that patch)."""

    kinds: tuple[str, ...] = ("actor", "critic")
    patched: tuple[bool, ...] = (True,)
    samples: int = 16
    prompt_length: int = 6
    response_length: int = 10
    mini_batch_size: int = 8
    micro_batch_size: int = 2
    epochs: int = 2
    max_samples: int | None = None

    def __call__(self, rank: int, world_size: int) -> dict[tuple[str, bool], Any]:
        from verl.single_controller.base.decorator import _split_args_kwargs_data_proto
        from verl.workers.engine_workers import TrainingWorker

        from verl_ext.integration import trace_hook
        from verl_ext.trace.batch_keys import ROW_KEY
        from verl_ext.patching import ORIGINAL_ATTR

        batch = trainer_batch(self.samples, self.prompt_length, self.response_length)
        batch[ROW_KEY] = trace_hook.rows(self.samples, self.max_samples)  # as the trainer's side marks it
        update_arguments(batch, self.mini_batch_size, self.epochs)
        (shares,), _ = _split_args_kwargs_data_proto(world_size, batch)
        outputs = {}
        for kind in self.kinds:
            for patched in self.patched:
                share = pickle.loads(pickle.dumps(shares[rank]))  # as Ray hands it to the worker: unlocked
                method = TrainingWorker.train_mini_batch
                method = method if patched else getattr(method, ORIGINAL_ATTR)
                outputs[kind, patched] = method(training_worker(kind, self.micro_batch_size), data=share)
        return outputs


def run_rank(rank: int, world_sizes: list[int], directory: str, job: Callable[[int, int], Any], results: Any) -> None:
    """In a spawned process: ``job`` in each world this rank belongs to (one gloo group at a time)."""
    import traceback

    import torch.distributed as dist

    import verl_ext.cpu

    for world_size in world_sizes:
        if rank >= world_size:
            continue
        try:
            verl_ext.cpu.activate()  # verl's device helpers answer "cpu"
            store = f"file://{os.path.join(directory, f'store-{world_size}')}"
            dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world_size)
            try:
                answer = job(rank, world_size)
            finally:
                dist.destroy_process_group()
        except BaseException:  # noqa: BLE001 - the parent waits for one answer per rank and world
            answer = RuntimeError(f"rank {rank} of {world_size}: {traceback.format_exc()}")
        results.put((world_size, rank, pickle.dumps(answer)))


def run_ranks(world_sizes: list[int], job: Callable[[int, int], Any]) -> dict[int, list[Any]]:
    """``job(rank, world_size)`` on every rank of a gloo group of each size, in max(world_sizes) spawned
    processes (each imports verl once): {world size: answers by rank}. ``job`` must be picklable (a
    module-level function, or a partial of one)."""
    from unittest import mock

    import torch.multiprocessing as mp

    from tests.support.forkserver import SPAWNED_VARIABLE

    context = mp.get_context("spawn")
    results = context.Queue()
    with tempfile.TemporaryDirectory() as directory:
        processes = [
            context.Process(target=run_rank, args=(rank, world_sizes, directory, job, results)) for rank in range(max(world_sizes))
        ]
        with mock.patch.dict(os.environ, {SPAWNED_VARIABLE: "1"}):  # a rank never asks for its parent
            for process in processes:
                process.start()
        collected = {}
        for _ in range(sum(world_sizes)):
            world_size, rank, answer = results.get(timeout=900)  # a rank that died without answering
            collected[world_size, rank] = pickle.loads(answer)
        for process in processes:
            process.join()
    for answer in collected.values():
        if isinstance(answer, RuntimeError):
            raise answer
    return {size: [collected[size, rank] for rank in range(size)] for size in world_sizes}


def driver_keeps(outputs: list[Any]):
    """verl's collect of ``train_mini_batch`` on the driver: every rank collects (no model parallelism),
    the outputs are concatenated and the first one kept."""
    from verl.single_controller.base.decorator import collect_nd_compute_dataproto
    from verl.single_controller.base.worker_group import WorkerGroup

    group = WorkerGroup.__new__(WorkerGroup)
    group._workers = list(outputs)
    return collect_nd_compute_dataproto([True] * len(outputs), group, list(outputs))
