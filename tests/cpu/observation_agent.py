"""A two-turn agent loop for the CPU tests: the policy writes a few tokens, an observation it did not
write follows (mask 0, as a tool's answer in verl's ToolAgentLoop), then the policy writes the rest.

It gives verl's real trainer multi-turn responses (holes inside ``response_mask``) without a tool
task: the arithmetic model never calls a tool, and this loop needs none. Selected with
``actor_rollout_ref.rollout.agent.default_agent_loop=observation_agent``; importing this module
registers it (tests/cpu/scenarios.py does, in the process that builds the agent loops).
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

#: Tokens the policy writes before the observation, and the observation's text (one token a character).
FIRST_TURN_TOKENS = 3
OBSERVATION = "=？"


@register("observation_agent")
class ObservationAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs) -> AgentLoopOutput:
        response_length = self.rollout_config.response_length
        deterministic = getattr(self.rollout_config, "full_determinism", False)
        request_id = f"det-{int(priority)}" if deterministic else uuid4().hex
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        ids, mask, log_probs = [], [], []
        extra_fields = {}

        async def write(max_tokens: int, last: bool) -> bool:
            """One assistant turn; True when it ended the response (EOS, or no room left). A turn
            before the last ends at an EOS after its first token and drops it, as a tool-calling loop
            ends a turn at its stop token: the arithmetic model often answers in fewer tokens than the
            first turn allows, and the multi-turn run needs (almost) every response to have two turns."""
            nonlocal extra_fields
            output = await self.server_manager.generate(
                request_id=request_id, prompt_ids=prompt_ids + ids, sampling_params={**sampling_params, "max_tokens": max_tokens}
            )
            extra_fields = extra_fields or dict(output.extra_fields)
            tokens = list(output.token_ids)
            token_log_probs = list(output.log_probs or [0.0] * len(tokens))
            eos = self.tokenizer.eos_token_id
            if not last and eos in tokens[1:]:
                end = tokens.index(eos, 1)
                tokens, token_log_probs = tokens[:end], token_log_probs[:end]
            ids.extend(tokens)
            mask.extend([1] * len(tokens))
            log_probs.extend(token_log_probs)
            return eos in tokens or len(ids) >= response_length

        turns = 1
        observation = self.tokenizer.encode(OBSERVATION, add_special_tokens=False)
        if not await write(FIRST_TURN_TOKENS, last=False) and len(ids) + len(observation) < response_length:
            ids.extend(observation)
            mask.extend([0] * len(observation))
            log_probs.extend([0.0] * len(observation))
            await write(response_length - len(ids), last=True)
            turns = 2
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=ids[:response_length],
            response_mask=mask[:response_length],
            response_logprobs=log_probs[:response_length],
            num_turns=2 * turns,
            metrics=AgentLoopMetrics(),
            extra_fields={**extra_fields, "turn_scores": [], "tool_rewards": []},
        )
