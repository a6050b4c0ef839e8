"""vLLM's own reason for ending each generation, carried to the trainer's batch.

verl's vLLM server reads vLLM's ``finish_reason`` ("stop": an end-of-sequence or stop token;
"length": the request's ``max_tokens`` reached) and hands the agent loop ``stop_reason="completed"``
for both (``vllm_async_server.py``, ``vLLMHttpServer.generate``): what vLLM knew about a response cut
at the length limit is lost. The wrapper here keeps it, in the generation's ``extra_fields`` under
:data:`STOP_REASON_KEY`, which verl carries to the batch (legacy: a non-tensor column; V1: the
``extra_fields`` field). A single-turn response has one generation; for a multi-turn response verl
keeps the first generation's ``extra_fields`` only, so the agent loop's record
(:mod:`verl_ext.integration.agent_turns`) sets the key to its last generation's reason.

The trace (:mod:`verl_ext.trace.capture`) records it per response beside its own ``truncated`` (the
EOS rule of docs/definitions.md#truncated-responses), and ``verl-ext check`` says where the two disagree.
"""

from __future__ import annotations

import functools
from typing import Any, AsyncIterator, Callable

#: The ``extra_fields`` key (and the legacy batch's non-tensor column) of vLLM's finish reason.
STOP_REASON_KEY = "verl_ext_stop_reason"


class _FinishReasons:
    """vLLM's ``AsyncLLM`` as verl's server holds it, keeping the finish reason of each request's
    last output until the server's ``generate`` takes it; every other attribute is the engine's."""

    def __init__(self, engine: Any):
        self._engine = engine
        self.reasons: dict[str, str | None] = {}

    def generate(self, *args: Any, request_id: str, **kwargs: Any) -> AsyncIterator[Any]:
        async def outputs():
            last = None
            async for output in self._engine.generate(*args, request_id=request_id, **kwargs):
                last = output
                yield output
            if last is not None and last.outputs:
                self.reasons[request_id] = last.outputs[0].finish_reason

        return outputs()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def wrap_vllm_server_generate(original: Callable) -> Callable:
    @functools.wraps(original)
    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        engine = getattr(self, "engine", None)
        if engine is not None and not isinstance(engine, _FinishReasons):
            self.engine = engine = _FinishReasons(engine)
        output = await original(self, prompt_ids, sampling_params, request_id, *args, **kwargs)
        if isinstance(engine, _FinishReasons) and output.extra_fields is not None:
            output.extra_fields[STOP_REASON_KEY] = engine.reasons.pop(request_id, None)
        return output

    return generate
