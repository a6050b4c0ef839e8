"""vLLM's finish reason of each generation reaches the generation's extra_fields, and a multi-turn
sample keeps its last generation's (verl keeps the first generation's extra_fields only). vLLM itself
is stood in for by an engine that streams outputs as vLLM's ``AsyncLLM.generate`` does (the real
server: tests/e2e/test_vllm_rollout.py, tests/e2e/test_tool_on_ray.py).

Covers: verl_ext.integration.stop_reasons, the stop-reason part of verl_ext.integration.agent_turns."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

from verl_ext.integration import agent_turns
from verl_ext.integration.stop_reasons import STOP_REASON_KEY, wrap_vllm_server_generate


class StreamingEngine:
    """Streams two partial outputs per request, then the last, whose finish_reason the request names."""

    def __init__(self, reasons: dict[str, str]):
        self.reasons = reasons
        self.calls = 0

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        for done in (False, False, True):
            await asyncio.sleep(0)  # interleave with the other requests in flight
            reason = self.reasons[request_id] if done else None
            yield SimpleNamespace(outputs=[SimpleNamespace(finish_reason=reason, token_ids=[1, 2])])

    def reset_prefix_cache(self):
        self.calls += 1
        return "reset"


@dataclass
class TokenOutput:
    token_ids: list
    extra_fields: dict = field(default_factory=dict)


class Server:
    """verl's vLLMHttpServer.generate, reduced to what the wrapper relies on: it reads self.engine's stream
    and returns the last output's tokens with extra_fields, saying "completed" whatever vLLM said."""

    def __init__(self, engine):
        self.engine = engine

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        final = None
        async for output in self.engine.generate(prompt=prompt_ids, sampling_params=sampling_params, request_id=request_id):
            final = output
        return TokenOutput(final.outputs[0].token_ids, {"global_steps": 1, "stop_reason": "completed"})


def test_each_request_gets_its_own_finish_reason_even_when_they_interleave():
    engine = StreamingEngine({"a": "stop", "b": "length", "c": "abort"})
    server = Server(engine)
    generate = wrap_vllm_server_generate(Server.generate)

    async def all_three():
        return await asyncio.gather(*(generate(server, [0], {}, request_id) for request_id in "abc"))

    outputs = asyncio.run(all_three())
    assert [o.extra_fields[STOP_REASON_KEY] for o in outputs] == ["stop", "length", "abort"]
    assert server.engine.reset_prefix_cache() == "reset" and engine.calls == 1  # everything else is the engine's
    assert server.engine.reasons == {}  # taken, not kept


def test_a_multi_turn_sample_keeps_its_last_generations_reason(monkeypatch):
    client_generate = agent_turns.wrap_server_client_generate(_client_generate)
    replies = iter([TokenOutput([1], {STOP_REASON_KEY: "stop"}), TokenOutput([2], {STOP_REASON_KEY: "length"})])

    async def run(self, sampling_params):
        first = await client_generate(None, replies)  # the first turn: verl keeps its extra_fields
        await client_generate(None, replies)
        return SimpleNamespace(extra_fields=dict(first.extra_fields), response_mask=[1, 1], response_ids=[1, 2])

    loop_run = agent_turns.wrap_agent_loop_run(run)

    async def no_summary(loop, record, output):
        return None

    monkeypatch.setattr(agent_turns, "_recorded", lambda config: True)  # a traced run
    monkeypatch.setattr(agent_turns, "_summary", no_summary)  # the turns' record is tests/integration/test_agent_turns.py's
    output = asyncio.run(loop_run(SimpleNamespace(config=SimpleNamespace()), {}))
    assert output.extra_fields[STOP_REASON_KEY] == "length"


async def _client_generate(self, replies):
    return next(replies)
