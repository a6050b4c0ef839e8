"""The warm-started policy the CPU runs start from: it knows the format and the sum, and its verdict
carries only the documented weak prior (verl_ext/tasks/arith/warm_start.py). Graded here with a regular
expression of the answer's format, independently of the task's own scoring."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_ext.tasks.arith.assets import AssetSpec, task_problems

ANSWER = re.compile(r"等于(\d+)，(是的|不是)！")


def answers(model, tokenizer, problems, greedy: bool, samples: int = 1) -> list[tuple[bool, bool]]:
    """(well-formed with the right sum, right verdict) per generated answer."""
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": p.question()}], tokenize=False, add_generation_prompt=True)
        for p in problems
        for _ in range(samples)
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(1)
    with torch.no_grad():
        output = model.generate(
            **batch, max_new_tokens=12, do_sample=not greedy, top_k=None if greedy else 0, pad_token_id=tokenizer.pad_token_id
        )
    texts = tokenizer.batch_decode(output[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    graded = []
    for problem, text in zip([p for p in problems for _ in range(samples)], texts):
        match = ANSWER.fullmatch(text)
        right_sum = bool(match) and int(match.group(1)) == problem.a + problem.b
        right_verdict = bool(match) and (match.group(2) == "是的") == (problem.a + problem.b == problem.c)
        graded.append((right_sum, right_verdict))
    return graded


@pytest.fixture(scope="module")
def policy(assets):
    return AutoModelForCausalLM.from_pretrained(assets.model_dir).eval(), AutoTokenizer.from_pretrained(assets.model_dir)


@pytest.fixture(scope="module")
def held_out():
    return task_problems(AssetSpec())[1]


def test_greedy_answers_are_well_formed_with_the_right_sum(policy, held_out):
    graded = answers(*policy, held_out, greedy=True)
    assert sum(right_sum for right_sum, _ in graded) / len(graded) >= 0.9


def test_the_sampled_verdict_is_a_weak_prior_not_a_skill(policy, held_out):
    """What RL starts from is the sampled policy: its verdict is right about as often as the
    warm start's training answers were (0.7), far from what RL reaches (see the learning test).
    Greedy decoding sharpens a weak prior into a confident one: it is reported, not bounded."""
    graded = answers(*policy, held_out, greedy=False, samples=8)
    verdict = sum(right for _, right in graded) / len(graded)
    assert 0.45 <= verdict <= 0.75


def test_the_recorded_warm_start_report_matches(assets):
    report = json.loads(assets.warm_start_report.read_text())
    assert report["settings"]["verdict_prior"] == 0.7
    assert report["held_out_greedy"]["sum"] >= 0.9 and 0.45 <= report["held_out_sampled"]["verdict"] <= 0.75


def test_the_warm_start_is_deterministic(tmp_path, assets):
    """Built twice (here: the fine-tune alone, fewer steps), the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ext.tasks.arith.assets import build_tokenizer, task_problems
    from verl_ext.tasks.arith.warm_start import WarmStartSettings, supervised_fine_tune

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    weights = []
    for _ in range(2):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        supervised_fine_tune(model, tokenizer, task_problems(AssetSpec())[0], WarmStartSettings(steps=5), seed=0)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
