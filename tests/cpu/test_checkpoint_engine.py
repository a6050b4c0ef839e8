"""The CPU backend's checkpoint engine (verl_ext.cpu.checkpoint_engine) on its own: a state dict from the
trainer's rank 0 to every rollout worker bit for bit, driven as verl's CheckpointEngineManager drives an
engine (prepare, build_topology, init_process_group, send and receive at once, finalize), and into
verl-ext's HF-generate server through its adapter, which reads the weights with a plain ``for``.

The verl runs that use it (the asynchronous trainers) are measured in docs/cpu_backend.md, not run here."""

from __future__ import annotations

import asyncio
import math
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from verl_ext.cpu import checkpoint_engine as engine_module
from verl_ext.cpu.checkpoint_engine import BACKEND, MODULE, CheckpointEngineError, SharedMemoryCheckpointEngine


def awkward_state_dict() -> dict[str, torch.Tensor]:
    """Every kind of tensor a model's state dict may hold, with bit patterns a value-wise copy could lose."""
    generator = torch.Generator().manual_seed(0)
    nan_payload = torch.tensor([0x7FC01234, 0x7F800001, 0xFFC00000 - 2**32], dtype=torch.int32).view(torch.float32)
    return {
        "model.embed_tokens.weight": torch.randn(17, 8, generator=generator),
        "model.layers.0.mlp.up_proj.weight": torch.randn(8, 12, generator=generator).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.randn(8, generator=generator).half(),
        "lm_head.weight": torch.randn(8, 17, generator=generator).double().t(),  # not contiguous
        "signed_zeros_and_nans": torch.cat([torch.tensor([0.0, -0.0, math.inf, -math.inf]), nan_payload]),
        "tiny_subnormal": torch.tensor([1e-45, -1e-45, 1e-40]),
        "step": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "empty": torch.empty(0, 3),
        "mask": torch.tensor([True, False, True]),
        "bytes": torch.arange(256, dtype=torch.uint8),
        "a_view": torch.arange(100, dtype=torch.float32)[10:20],  # a view of a larger storage: its own bytes only
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def exchange(senders, receivers, state_dict, global_steps=3, sender_weights=None):
    """One weight update as verl's CheckpointEngineManager runs it; returns what each receiver got, in order."""
    cls = type(senders[0])
    metadata = [engine.prepare() for engine in senders + receivers]
    actor_kwargs, rollout_kwargs = cls.build_topology(len(senders), len(receivers), metadata)
    for group, kwargs in ((senders, actor_kwargs), (receivers, rollout_kwargs)):
        for rank, engine in enumerate(group):
            engine.init_process_group(**{key: values[rank] for key, values in kwargs.items()})
    received = [[] for _ in receivers]
    errors = []

    def receive(index):  # each rollout worker in its own process in a run: here its own thread
        try:
            received[index].extend(receivers[index].receive_weights(global_steps=global_steps))
        except Exception as error:  # noqa: BLE001 - the test asserts on it
            errors.append(error)

    threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(receivers))]
    for thread in threads:
        thread.start()

    async def send_all():
        weights = sender_weights or (lambda: iter(state_dict.items()))
        return await asyncio.gather(*(engine.send_weights(weights(), global_steps=global_steps) for engine in senders), return_exceptions=True)

    sent = asyncio.run(send_all())
    for thread in threads:
        thread.join(timeout=60)
    folder = senders[0].folder
    for engine in senders + receivers:
        engine.finalize()
    return received, errors, sent, folder


def test_verl_finds_the_engine_by_the_module_named_in_its_config():
    """verl's own lookup: import custom_backend_module, then the registry by backend name (engine_workers.py:685)."""
    from verl.checkpoint_engine import CheckpointEngineRegistry
    from verl.utils.import_utils import import_external_libs

    import_external_libs(MODULE)
    assert CheckpointEngineRegistry.get(BACKEND) is SharedMemoryCheckpointEngine
    # the keyword arguments verl passes: the trainer's engines get is_master, the rollout's only the bucket size
    trainer = CheckpointEngineRegistry.new(BACKEND, is_master=True, bucket_size=2048 << 20)
    rollout = CheckpointEngineRegistry.new(BACKEND, bucket_size=2048 << 20, timeout_s=5)
    assert trainer.is_master and not rollout.is_master and rollout.timeout_s == 5


def test_a_state_dict_reaches_every_rollout_worker_bit_for_bit_and_in_order(tmp_path):
    state_dict = awkward_state_dict()
    senders = [SharedMemoryCheckpointEngine(is_master=True, directory=str(tmp_path)), SharedMemoryCheckpointEngine()]
    receivers = [SharedMemoryCheckpointEngine(directory=str(tmp_path)) for _ in range(2)]
    walked = []

    def weights():  # the trainer's rank 1 walks the generator too: producing each full tensor is collective
        for name, tensor in state_dict.items():
            walked.append(name)
            yield name, tensor

    received, errors, sent, folder = exchange(senders, receivers, state_dict, sender_weights=weights)
    assert not errors and sent == [{}, {}]
    assert walked == list(state_dict) * 2
    for got in received:
        assert [name for name, _ in got] == list(state_dict)
        for name, tensor in got:
            assert same_bits(tensor, state_dict[name]), name
    assert folder.parent == tmp_path and not folder.exists()  # finalize removes the exchange folder
    assert list(tmp_path.iterdir()) == []


def test_each_update_has_a_folder_of_its_own_under_shared_memory():
    sender, receiver = SharedMemoryCheckpointEngine(is_master=True), SharedMemoryCheckpointEngine()
    folders = []
    for step, scale in ((1, 1.0), (2, 2.0)):
        state_dict = {"w": torch.ones(3) * scale}
        received, errors, _, folder = exchange([sender], [receiver], state_dict, global_steps=step)
        assert not errors and same_bits(received[0][0][1], state_dict["w"])
        folders.append(folder)
    assert folders[0] != folders[1] and all(f.name.startswith(engine_module.FOLDER_PREFIX) for f in folders)
    if Path(engine_module.DEFAULT_PARENT).is_dir():
        assert folders[0].parent == Path(engine_module.DEFAULT_PARENT)


def test_a_sender_that_fails_is_one_line_on_every_rollout_worker(tmp_path):
    def weights():
        yield "w", torch.ones(2)
        raise RuntimeError("the trainer ran out of memory\nwith a traceback below")

    sender = SharedMemoryCheckpointEngine(is_master=True, directory=str(tmp_path))
    receivers = [SharedMemoryCheckpointEngine() for _ in range(2)]
    _, errors, sent, _ = exchange([sender], receivers, {}, sender_weights=weights)
    assert isinstance(sent[0], RuntimeError)
    assert [str(e) for e in errors] == [
        f"checkpoint engine {BACKEND}: the trainer could not write its weights: the trainer ran out of memory"
    ] * 2


def test_a_rollout_worker_waits_for_the_weights_no_longer_than_its_timeout(tmp_path):
    sender = SharedMemoryCheckpointEngine(is_master=True, directory=str(tmp_path))
    receiver = SharedMemoryCheckpointEngine(timeout_s=0.2)
    actor, rollout = SharedMemoryCheckpointEngine.build_topology(1, 1, [sender.prepare(), receiver.prepare()])
    receiver.init_process_group(**{k: v[0] for k, v in rollout.items()})
    with pytest.raises(CheckpointEngineError) as waited:
        list(receiver.receive_weights())
    assert str(waited.value) == (
        f"checkpoint engine {BACKEND}: no weights from the trainer in {actor['folder'][0]} after 0.2 s "
        f"(checkpoint_engine.engine_kwargs.{BACKEND}.timeout_s)"
    )
    sender.finalize()


def test_weights_of_another_step_are_refused(tmp_path):
    sender, receiver = SharedMemoryCheckpointEngine(is_master=True, directory=str(tmp_path)), SharedMemoryCheckpointEngine()
    _, rollout = SharedMemoryCheckpointEngine.build_topology(1, 1, [sender.prepare(), receiver.prepare()])
    for engine, kwargs in ((sender, {"folder": rollout["folder"][0], "rank": 0}), (receiver, {k: v[0] for k, v in rollout.items()})):
        engine.init_process_group(**kwargs)
    asyncio.run(sender.send_weights(iter({"w": torch.ones(1)}.items()), global_steps=4))
    with pytest.raises(CheckpointEngineError, match="asked for the weights of step 5 and .* holds those of step 4"):
        list(receiver.receive_weights(global_steps=5))
    sender.finalize()


def test_workers_on_another_machine_are_refused_in_one_line():
    metadata = [{"host": "a", "folder": "/dev/shm/x"}, {"host": "a", "folder": None}, {"host": "b", "folder": None}]
    with pytest.raises(CheckpointEngineError) as refused:
        SharedMemoryCheckpointEngine.build_topology(1, 2, metadata)
    assert str(refused.value) == (
        f"checkpoint engine {BACKEND} passes the weights through one machine's shared memory, and the trainer's rank 0 "
        "is on a while workers are on b: run the trainer and the rollout on one machine"
    )


def hf_server(assets):
    from verl_ext.hf_rollout.server import HFGenerationServer

    config = SimpleNamespace(response_length=4, max_model_len=None, prompt_length=16, seed=0)
    return HFGenerationServer(str(assets.model_dir), config, replica_rank=0)


def test_the_weights_reach_the_hf_generate_server_through_its_adapter(assets, tmp_path, monkeypatch):
    """The rollout side as verl's CheckpointEngineWorker runs it: receive_weights' generator handed to the
    rollout's adapter (HFServerAdapter, which reads it with a plain for) and on to its server."""
    from verl_ext.hf_rollout import server as server_module
    from verl_ext.hf_rollout.server import HFServerAdapter

    server = hf_server(assets)
    generator = torch.Generator().manual_seed(1)
    state_dict = {name: torch.randn(p.shape, generator=generator, dtype=torch.float32) for name, p in server.model.named_parameters()}

    class Handle:  # what locate_server returns: a Ray actor handle, here the server itself
        class update_weights:  # noqa: N801
            @staticmethod
            async def remote(weights, global_steps):
                await server.update_weights(weights, global_steps)

    monkeypatch.setattr(server_module, "locate_server", lambda rank: Handle)
    adapter = HFServerAdapter.__new__(HFServerAdapter)  # verl's BaseRollout constructor needs a full rollout config
    adapter.replica_rank, adapter.owns_server = 0, True
    sender, receiver = SharedMemoryCheckpointEngine(is_master=True, directory=str(tmp_path)), SharedMemoryCheckpointEngine()
    actor, rollout = SharedMemoryCheckpointEngine.build_topology(1, 1, [sender.prepare(), receiver.prepare()])
    sender.init_process_group(**{k: v[0] for k, v in actor.items()})
    receiver.init_process_group(**{k: v[0] for k, v in rollout.items()})

    async def update():  # the two sides at once, as the manager's ray.get of both
        send = asyncio.create_task(sender.send_weights(iter(state_dict.items()), global_steps=6))
        await asyncio.to_thread(lambda: asyncio.run(adapter.update_weights(receiver.receive_weights(global_steps=6), global_steps=6)))
        await send

    asyncio.run(update())
    sender.finalize()
    assert server.global_steps == 6
    for name, parameter in server.model.named_parameters():  # the server computes in float64: each float32 exactly
        assert torch.equal(parameter.detach(), state_dict[name].double()), name


def test_the_server_reports_the_weights_that_generated_a_response(assets):
    """An asynchronous trainer's weight update may land after a response is generated and before its
    request's coroutine resumes: the response keeps the version it was generated with."""
    server = hf_server(assets)
    server.global_steps = 3
    original = server._generate_batch

    def generate_then_update(*args, **kwargs):
        results = original(*args, **kwargs)
        # runs after _drain sets the futures and before the waiting request resumes (call_soon is FIFO)
        asyncio.get_running_loop().call_soon(setattr, server, "global_steps", 4)
        return results

    server._generate_batch = generate_then_update

    async def request():
        return await server.generate("r-0", [1, 2, 3], {"temperature": 1.0, "max_tokens": 2})

    output = asyncio.run(request())
    assert server.global_steps == 4 and output.extra_fields["global_steps"] == 3
