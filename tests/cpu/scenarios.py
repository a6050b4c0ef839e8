"""Scenarios the CPU tests run, each in a fresh interpreter (platform, registries and patches are
process-global). Usage::

    python tests/cpu/scenarios.py in-process OUTPUT_DIR --estimator gae --steps 2 [-- OVERRIDE ...]
    python tests/cpu/scenarios.py in-process OUTPUT_DIR --estimator mc --config-dir configs \
        --config-name verl_ext_trainer -- algorithm.use_kl_in_reward=True
    python tests/cpu/scenarios.py hf-server OUTPUT_DIR

Each writes its results under OUTPUT_DIR for the test to assert on: ``batches.pt`` (the batch the
trainer used at each step, see ``BatchRecorder``, and how often the agent loop was built and run)
and verl's ``metrics.jsonl``, or ``server.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def in_process(args: argparse.Namespace, extra: list[str]):
    import torch

    import verl_ext.cpu

    verl_ext.cpu.activate()
    from verl_ext.tasks.arith.assets import build_assets
    from verl_ext.cpu.in_process import BatchRecorder, run_in_process
    from verl_ext.cpu.overrides import cpu_overrides, merge_overrides

    import observation_agent  # noqa: F401  registers the two-turn agent loop (default_agent_loop=observation_agent)

    overrides = cpu_overrides(
        build_assets(),
        args.output_dir,
        steps=args.steps,
        estimator=args.estimator,
        rollout_n=args.rollout_n,
        train_batch_size=args.batch_size,
        use_ray=False,
    )
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    agent_loops = {"built": 0, "runs": 0}  # how often verl's single-turn agent loop is built and run
    build, run = SingleTurnAgentLoop.__init__, SingleTurnAgentLoop.run

    def counted_build(self, *a, **kw):
        agent_loops["built"] += 1
        build(self, *a, **kw)

    async def counted_run(self, *a, **kw):
        agent_loops["runs"] += 1
        return await run(self, *a, **kw)

    SingleTurnAgentLoop.__init__, SingleTurnAgentLoop.run = counted_build, counted_run
    recorder = BatchRecorder()

    def on_batch(step, batch, trainer):
        recorder(step, batch, trainer)
        if "values_after_last" in batch.batch.keys():
            recorder.steps[step]["separate_values_after_last"] = critic_at_the_end(batch, trainer)

    trainer = run_in_process(
        merge_overrides(overrides, extra), on_batch=on_batch, config_dir=args.config_dir, config_name=args.config_name
    )
    torch.save(
        {"steps": recorder.steps, "gamma": trainer.config.algorithm.gamma, "lam": trainer.config.algorithm.lam,
         "agent_loops": agent_loops},
        args.output_dir / "batches.pt",
    )  # fmt: skip


def critic_at_the_end(batch, trainer):
    """V(s_L) of every response by a forward pass of its own: the critic's model (verl's worker in this
    process, with the weights that computed this step's values: on_batch runs before the critic's
    update) on the full sequence alone, unpadded, at its last token. (B,) float32."""
    import torch

    module = trainer.critic_wg.worker.engine.module
    ids, attention = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    out = []
    with torch.no_grad():
        for row in range(len(ids)):
            sequence = ids[row][attention[row]][None]
            positions = torch.arange(sequence.shape[1])[None]
            logits = module(input_ids=sequence, attention_mask=torch.ones_like(sequence), position_ids=positions).logits
            out.append(logits[0, -1, 0].float())
    return torch.stack(out)


def hf_server(output_dir: Path):
    """Drive HFGenerationServer directly: concurrent requests, EOS handling, weight updates."""
    import asyncio
    from types import SimpleNamespace

    import verl_ext.cpu

    verl_ext.cpu.activate()
    import torch
    from transformers import AutoTokenizer

    from verl_ext.tasks.arith.assets import build_assets
    from verl_ext.hf_rollout.server import HFGenerationServer

    assets = build_assets()
    tokenizer = AutoTokenizer.from_pretrained(assets.model_dir)
    chats = [[{"role": "user", "content": question}] for question in ("1+2=", "请问3+4=6？", "请问1+1=2？")]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        for chat in chats
    ]
    config = SimpleNamespace(prompt_length=16, response_length=12, max_model_len=None, seed=0)
    server = HFGenerationServer(str(assets.model_dir), config)
    calls = []
    generate = server.model.generate
    server.model.generate = lambda **kwargs: calls.append(kwargs["input_ids"].shape) or generate(**kwargs)

    async def requests(sampling):
        return await asyncio.gather(*[server.generate(f"r{i}", p, sampling) for i, p in enumerate(prompts)])

    sampled = asyncio.run(requests({"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}))
    greedy_a = asyncio.run(requests({"temperature": 0, "logprobs": False}))
    greedy_b = asyncio.run(requests({"temperature": 0, "logprobs": False}))
    # a stop token (verl's stop_token_ids) ends the response like EOS, and is kept
    stop = greedy_a[0].token_ids[1]
    stopped = asyncio.run(server.generate("s", prompts[0], {"temperature": 0, "stop_token_ids": [stop]}))
    state = {name: torch.zeros_like(p) for name, p in server.model.state_dict().items()}
    asyncio.run(server.update_weights(state, global_steps=7))
    after = asyncio.run(requests({"temperature": 0, "logprobs": False}))
    determinism = deterministic_sampling(assets, tokenizer, prompts, config)
    result = {
        **determinism,
        "generate_calls": [list(shape) for shape in calls],
        "eos_token_id": server.eos_token_id,
        "sampled": [o.model_dump() for o in sampled],
        "greedy_a": [o.token_ids for o in greedy_a],
        "greedy_b": [o.token_ids for o in greedy_b],
        "stopped": stopped.token_ids,
        "after_update": [o.model_dump() for o in after],
        "response_length": config.response_length,
        "prompt_lengths": [len(p) for p in prompts],
        "model_devices": sorted({str(p.device) for p in server.model.parameters()}),
    }
    (output_dir / "server.json").write_text(json.dumps(result))


def deterministic_sampling(assets, tokenizer, prompts, config) -> dict:
    """Request ids det-<i> (verl's rollout.full_determinism): each request's sample depends on its id,
    the stream and the weights version alone; and the samples follow the model's distribution.

    Drawn at an undecided position, the verdict after "请问3+4=6？" + "等于7，" (the warm start is
    near-certain elsewhere, where every stream would give the same tokens and the checks would
    have no power)."""
    import asyncio

    import torch

    from verl_ext.hf_rollout.server import HFGenerationServer

    sampling = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    context = prompts[1] + tokenizer.encode("等于7，", add_special_tokens=False)

    def fresh():
        return HFGenerationServer(str(assets.model_dir), config)

    # three different prompts and 24 copies of the undecided one, 4 tokens each
    contexts = prompts + [context] * 24
    ids = [f"det-{i}" for i in range(len(contexts))]
    short = {**sampling, "max_tokens": 4}

    async def together(server, order):
        outputs = await asyncio.gather(*[server.generate(ids[i], contexts[i], short) for i in order])
        return {ids[i]: (o.token_ids, o.log_probs) for i, o in zip(order, outputs)}

    async def one_by_one(server, order):
        outputs = [await server.generate(ids[i], contexts[i], short) for i in order]
        return {ids[i]: (o.token_ids, o.log_probs) for i, o in zip(order, outputs)}

    forward = list(range(len(ids)))
    server = fresh()
    batched, repeated = asyncio.run(together(server, forward)), asyncio.run(together(server, forward))
    server.use_stream("validation")
    other_stream = asyncio.run(together(server, forward))
    alone = asyncio.run(one_by_one(fresh(), forward[::-1]))

    # requests that may get different numbers of tokens (as the turns of a multi-turn rollout do)
    asked = [(1, 2, 4, 3)[i % 4] for i in range(len(ids))]

    async def of_mixed_lengths(server, order, together: bool):
        requests = [server.generate(ids[i], contexts[i], {**sampling, "max_tokens": asked[i]}) for i in order]
        outputs = await asyncio.gather(*requests) if together else [await r for r in requests]
        return {ids[i]: (o.token_ids, o.log_probs) for i, o in zip(order, outputs)}

    server = fresh()
    calls = []
    generate = server.model.generate
    server.model.generate = lambda **kwargs: calls.append(kwargs["max_new_tokens"]) or generate(**kwargs)
    mixed_batched = asyncio.run(of_mixed_lengths(server, forward, True))
    mixed_alone = asyncio.run(of_mixed_lengths(fresh(), forward[::-1], False))

    # the verdict sampled 3000 times against the model's own probabilities there (one forward pass)
    server = fresh()
    one_token = {**sampling, "max_tokens": 1}

    async def verdicts():
        outputs = await asyncio.gather(*[server.generate(f"det-{i}", context, one_token) for i in range(3000)])
        return [o.token_ids[0] for o in outputs]

    drawn = asyncio.run(verdicts())
    with torch.no_grad():
        logits = server.model(input_ids=torch.tensor([context])).logits[0, -1]
    probabilities = torch.softmax(logits.double(), dim=-1)
    candidates = [tokenizer.convert_tokens_to_ids(ch) for ch in ("是", "不")]
    return {
        "det_batched": [batched[i][0] for i in ids],
        "det_alone": [alone[i][0] for i in ids],
        "det_batched_log_probs": [batched[i][1] for i in ids],
        "det_alone_log_probs": [alone[i][1] for i in ids],
        "det_repeated": [repeated[i][0] for i in ids],
        "mixed_asked": asked,
        "mixed_calls": calls,
        "mixed_batched": [mixed_batched[i] for i in ids],
        "mixed_alone": [mixed_alone[i] for i in ids],
        "det_other_stream": [other_stream[i][0] for i in ids],
        "verdict_frequency": [drawn.count(token) / len(drawn) for token in candidates],
        "verdict_probability": [float(probabilities[token]) for token in candidates],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["in-process", "hf-server"])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--estimator", default="gae")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rollout-n", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--config-dir", default=None, help="a config directory (default: verl's own)")
    parser.add_argument("--config-name", default="ppo_trainer")
    argv = sys.argv[1:]
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []  # hydra overrides after "--"
    args = parser.parse_args(argv[: len(argv) - len(overrides) - (1 if "--" in argv else 0)])
    args.output_dir.mkdir(parents=True, exist_ok=True)
    if args.scenario == "in-process":
        in_process(args, overrides)
    else:
        hf_server(args.output_dir)


if __name__ == "__main__":
    main()
