"""In-process stand-ins for Ray actors, for running verl's own actor classes without Ray.

verl's agent loop, reward loop and rollout servers talk to each other through Ray actor handles:
``await handle.method.remote(...)``. Inside a Ray actor each of them lives on a persistent event
loop, and some capture that loop when constructed (``RewardLoopWorker.__init__`` and the reward
managers call ``get_event_loop()``). Run in a plain process, verl's ``auto_await`` would give every
call a fresh ``asyncio.run`` loop and those objects would fail with "Future attached to a
different loop".

So the in-process runner builds those objects on one :class:`ActorLoop` (a daemon thread running
an event loop forever) and hands out :class:`LocalActorHandle` objects whose ``.method.remote()``
schedules the call on that loop and returns an awaitable, like a Ray ``ObjectRef``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from typing import Any, Callable


class ActorLoop:
    """A persistent event loop on a daemon thread: the home of every in-process actor."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, name="verl-ext-actor-loop", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, function: Callable[..., Any], *args, **kwargs) -> concurrent.futures.Future:
        """Run ``function(*args, **kwargs)`` on the loop thread (awaited if it is a coroutine function)."""

        async def invoke():
            result = function(*args, **kwargs)
            return await result if inspect.isawaitable(result) else result

        return asyncio.run_coroutine_threadsafe(invoke(), self.loop)

    def call(self, function: Callable[..., Any], *args, **kwargs) -> Any:
        """Like :meth:`submit`, and wait for the result. Never call this from the loop thread itself."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("ActorLoop.call from the actor loop would deadlock; await a .remote() instead")
        return self.submit(function, *args, **kwargs).result()


_actor_loop: ActorLoop | None = None
_actor_loop_lock = threading.Lock()


def actor_loop() -> ActorLoop:
    """This process' actor loop (created on first use)."""
    global _actor_loop
    with _actor_loop_lock:
        if _actor_loop is None:
            _actor_loop = ActorLoop()
        return _actor_loop


class LocalObjectRef:
    """What ``handle.method.remote()`` returns: awaitable from any event loop, or ``.result()``."""

    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def __await__(self):
        return asyncio.wrap_future(self._future).__await__()

    def result(self, timeout: float | None = None) -> Any:
        return self._future.result(timeout)


class _RemoteMethod:
    def __init__(self, method: Callable[..., Any], loop: ActorLoop):
        self._method = method
        self._loop = loop

    def remote(self, *args, **kwargs) -> LocalObjectRef:
        return LocalObjectRef(self._loop.submit(self._method, *args, **kwargs))


class LocalActorHandle:
    """A Ray-actor-handle look-alike for an object living on the actor loop."""

    def __init__(self, instance: Any, loop: ActorLoop):
        self._instance = instance
        self._loop = loop

    @classmethod
    def create(cls, actor_cls: type, *args, **kwargs) -> "LocalActorHandle":
        """Construct ``actor_cls(*args, **kwargs)`` on the actor loop thread, as Ray would in the actor."""
        loop = actor_loop()
        return cls(loop.call(actor_cls, *args, **kwargs), loop)

    @property
    def instance(self) -> Any:
        return self._instance

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("__"):
            raise AttributeError(name)
        return _RemoteMethod(getattr(self._instance, name), self._loop)


class ThisNodeWorker:
    """What verl's vLLM replica asks of each worker it is given before it starts its server (a Ray actor
    in verl's trainer: ``worker.__ray_call__.remote(fn)`` for its node and device): the in-process
    runner's worker is no Ray actor; it is on this node, device 0. Picklable: verl hands it on to the
    server, which keeps it unused (it reads its workers only with vLLM's data parallelism)."""

    def __init__(self, node_id: str):
        self.answer = (node_id, "0")

    @property
    def __ray_call__(self):
        answer = self.answer

        class _Call:
            @staticmethod
            def remote(function):
                future = asyncio.get_running_loop().create_future()
                future.set_result(answer)
                return future

        return _Call
