"""The in-process actor stand-ins: one persistent loop, handles that behave like Ray's."""

from __future__ import annotations

import asyncio
import threading

import pytest

from verl_ext.cpu.local_actor import LocalActorHandle, actor_loop


class Recorder:
    """Captures the loop it was built on, as verl's RewardLoopWorker does (get_event_loop())."""

    def __init__(self, label):
        self.label = label
        self.loop = asyncio.get_event_loop()
        self.thread = threading.current_thread().name

    async def where(self):
        await asyncio.sleep(0)
        return asyncio.get_running_loop() is self.loop, threading.current_thread().name

    def add(self, a, b):
        return a + b

    async def call_other(self, other):
        return await other.add.remote(2, 3)


def test_an_actor_is_built_and_runs_on_the_actor_loop():
    handle = LocalActorHandle.create(Recorder, "x")
    assert handle.instance.thread == "verl-ext-actor-loop"
    assert handle.instance.loop is actor_loop().loop
    same_loop, thread = handle.where.remote().result(timeout=5)
    assert same_loop and thread == "verl-ext-actor-loop"


def test_remote_calls_are_awaitable_from_another_loop():
    handle = LocalActorHandle.create(Recorder, "y")

    async def caller():  # what verl's auto_await does: a fresh asyncio.run loop in the main thread
        return await handle.add.remote(1, 2), await handle.where.remote()

    total, (same_loop, _) = asyncio.run(caller())
    assert total == 3 and same_loop


def test_actors_can_await_each_other_on_the_shared_loop():
    first, second = LocalActorHandle.create(Recorder, "a"), LocalActorHandle.create(Recorder, "b")
    assert first.call_other.remote(second).result(timeout=5) == 5


def test_blocking_on_the_loop_from_the_loop_is_refused():
    loop = actor_loop()
    with pytest.raises(RuntimeError, match="deadlock"):
        loop.submit(loop.call, lambda: None).result(timeout=5)
