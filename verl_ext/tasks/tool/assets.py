"""The tool task's assets, built at run time like the arithmetic task's (nothing downloaded).

``build_assets()`` writes, once per spec, into the same cache as :mod:`verl_ext.tasks.arith.assets`
(:func:`verl_ext.tasks.common.cached_build`):

* ``model/``: the same tiny ``llama`` (hidden 128, 2 layers), warm-started on both paths
  (:mod:`verl_ext.tasks.tool.warm_start`), with the tokenizer below;
* ``warm_start.json``: its settings, loss, time, and the held-out evaluation (how often it calls,
  how often its head and the tool path get the answer right);
* ``critic/``: the pretrained critic (:mod:`verl_ext.tasks.tool.value_pretraining`): the warm start
  with verl's value head, trained on the warm start's own rollouts through the agent loop's steps,
  tool holes included; ``value_pretraining.json`` reports its held-out fit at the first token, after
  the tool's answer and after the verdict, and the time;
* ``train.parquet`` / ``val.parquet``: verl RLHFDataset rows with ``agent_name: tool_agent``, so
  verl's own ``ToolAgentLoop`` runs every prompt.

``describe()`` prints what the demo shows of them before training.

What the tokenizer and chat template give verl's tool agent loop (hermes format):

* a ``tool`` role (``<|tool|>``), and a template that renders system, user, assistant (its
  ``tool_calls`` ignored: verl never re-renders what the model wrote) and tool messages, and is
  prefix-stable (verl renders a tool message as the difference of two renders);
* ``<tool_call>``, ``</tool_call>``, ``<tool_response>``, ``</tool_response>`` as plain (not special)
  tokens: the hermes parser finds calls in decoded text, and the reward, which decodes without
  special tokens, finds the final answer after ``</tool_response>``;
* an assistant turn ends with EOS: the hermes parser gives the server no stop tokens;
* the call's fixed JSON pieces as single tokens (:data:`verl_ext.tasks.tool.task.CALL_PREFIX`, …),
  so a call is a few tokens; every other character is one token.

The template ignores the tool schemas verl passes: character tokens would make them hundreds of
prompt tokens, and the model learns its one tool in the warm start.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

from verl_ext.tasks.arith.assets import CHARACTERS as ARITH_CHARACTERS
from verl_ext.tasks.arith.task import Problem
from verl_ext.tasks.assets import TaskAssetSpec
from verl_ext.tasks.common import EOS, ROLE_TOKENS, cached_build, character_tokenizer, tiny_llama
from verl_ext.tasks.tool import reward
from verl_ext.tasks.tool.task import (
    CALL_END, CALL_PREFIX, CALL_SEPARATOR, CALL_START, CALL_SUFFIX, RESPONSE_END, RESPONSE_START, call_text, problem_sets,
)  # fmt: skip
from verl_ext.tasks.tool.warm_start import WarmStartSettings
from verl_ext.tasks.value_pretraining import ValuePretrainingSettings

ASSETS_FORMAT = 2
#: The file verl loads by path to register the calculator. Never imported here: verl's loader
#: returns only the tools a load newly registers, so a process that imported it first gets none.
TOOLS_FILE = Path(__file__).resolve().parent / "tools.py"
TOOL_ROLE = "<|tool|>"
PLAIN_TOKENS = (CALL_START, CALL_END, RESPONSE_START, RESPONSE_END, CALL_PREFIX, CALL_SEPARATOR, CALL_SUFFIX)
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>"
    "{% if message['role'] == 'tool' %}" + RESPONSE_START + "{{ message['content'] }}" + RESPONSE_END + ""
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% if message['role'] == 'assistant' %}" + EOS + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
DATA_SOURCE = "verl_ext/sum_check_tool"
AGENT_NAME = "tool_agent"


@dataclass(frozen=True)
class AssetSpec(TaskAssetSpec):
    """Everything that determines the content of the assets (hashed into the cache key): the fields
    every task has (:class:`verl_ext.tasks.assets.TaskAssetSpec`), then the tool task's own."""

    digits: int = 2
    #: Distinct problems the warm start sees (fewer than there are pairs: the head cannot memorise).
    warm_start_problems: int = 8192
    warm_start: WarmStartSettings = field(default_factory=WarmStartSettings)
    value_pretraining: ValuePretrainingSettings = field(default_factory=ValuePretrainingSettings)
    format: int = ASSETS_FORMAT
    KEY_PREFIX: ClassVar[str] = "tool-"


@dataclass(frozen=True)
class ToolAssets:
    """Paths of one built asset set, and what a run on them needs (:class:`verl_ext.cpu.overrides.RunAssets`)."""

    root: Path
    model_dir: Path
    train_file: Path
    val_file: Path
    reward_file: Path
    tools_file: Path
    warm_start_report: Path
    critic_dir: Path
    value_pretraining_report: Path
    reward_name: str = "compute_score"
    #: "<|user|>请问123+456=579？<|assistant|>": 17 tokens.
    max_prompt_length: int = 20
    #: The tool path: a call of 12 tokens, the tool's message of 7, an answer of 10.
    max_response_length: int = 32

    @property
    def overrides(self) -> tuple[str, ...]:
        """verl's tool agent loop with the calculator (rows pick the loop with ``agent_name``)."""
        return (
            f"data.max_response_length={self.max_response_length}",
            "actor_rollout_ref.rollout.multi_turn.enable=True",
            "actor_rollout_ref.rollout.multi_turn.format=hermes",
            f"actor_rollout_ref.rollout.multi_turn.function_tool_path={self.tools_file}",
            # one call and the answer: a second call ends the response at the turn limit
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
            # verl's error texts (a malformed call) are ~60 characters, mostly unknown to the tokenizer
            "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=16",
            "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=right",
        )


def build_assets(cache_dir=None, spec: AssetSpec = AssetSpec()) -> ToolAssets:
    """Build the assets for ``spec`` under ``cache_dir`` unless they already exist; return their paths."""
    target = cached_build(cache_dir, spec, lambda staging: _build(staging, spec))
    return ToolAssets(
        root=target,
        model_dir=target / "model",
        train_file=target / "train.parquet",
        val_file=target / "val.parquet",
        reward_file=Path(reward.__file__).resolve(),
        tools_file=TOOLS_FILE,
        warm_start_report=target / "warm_start.json",
        critic_dir=target / "critic",
        value_pretraining_report=target / "value_pretraining.json",
    )


def build_tool_tokenizer():
    return character_tokenizer(
        ARITH_CHARACTERS, roles=(*ROLE_TOKENS, TOOL_ROLE), plain_tokens=PLAIN_TOKENS, chat_template=CHAT_TEMPLATE
    )


def prompt_row(p: Problem, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "agent_name": AGENT_NAME,
        "prompt": [{"role": "user", "content": p.question()}],
        "reward_model": {"style": "rule", "ground_truth": p.answer()},
        "extra_info": {"split": split, "index": index},
    }


def _build(staging: Path, spec: AssetSpec) -> None:
    import pandas as pd

    from verl_ext.tasks.tool.warm_start import evaluate, supervised_fine_tune

    sets = problem_sets(spec.seed, spec.digits, spec.max_delta, spec.train_rows + spec.warm_start_problems, spec.val_problems)
    train, warm_start_problems = sets.train[: spec.train_rows], sets.train
    for split, problems in (("train", train), ("val", sets.val)):
        pd.DataFrame([prompt_row(p, split, i) for i, p in enumerate(problems)]).to_parquet(staging / f"{split}.parquet")

    tokenizer = build_tool_tokenizer()
    model = tiny_llama(tokenizer, spec)
    settings = spec.warm_start
    print(
        f"[verl-ext] building the tool task's assets: warm start, {settings.steps} supervised steps (~40 s) ...",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    started = time.monotonic()
    loss = supervised_fine_tune(model, tokenizer, warm_start_problems, settings, seed=spec.seed)
    seconds = time.monotonic() - started
    held_out = evaluate(model, tokenizer, sets.val)
    model.save_pretrained(staging / "model")
    tokenizer.save_pretrained(staging / "model")
    report = {"settings": asdict(settings), "final_loss": loss, "seconds": round(seconds, 1), "held_out": asdict(held_out)}
    (staging / "warm_start.json").write_text(json.dumps(report, indent=2))
    print(
        f"[verl-ext] warm start done in {seconds:.0f} s; held out: calls the tool with probability "
        f"{held_out.call_probability:.2f}; greedy answer right {held_out.tool_acc:.2f} through the tool, "
        f"{held_out.head_acc:.2f} from its head (sum right {held_out.tool_sum:.2f} / {held_out.head_sum:.2f})",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    _pretrain_critic(staging, spec, model, tokenizer, train, sets.val)


def _pretrain_critic(staging: Path, spec: AssetSpec, model, tokenizer, train: list[Problem], val: list[Problem]) -> None:
    from verl_ext.tasks.tool.value_pretraining import RolloutLimits, pretrain_value
    from verl_ext.tasks.value_pretraining import save_critic

    print("[verl-ext] pretraining the critic on the warm start's own rollouts, tool holes included ...", file=sys.stderr, flush=True)
    limits = RolloutLimits(ToolAssets.max_prompt_length, ToolAssets.max_response_length)
    critic, report = pretrain_value(model, tokenizer, train, val, spec.value_pretraining, spec.seed, limits)
    save_critic(staging, critic, tokenizer, report)


def _ev(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def describe() -> None:
    """The task and its warm start, as the demo shows them before training (the assets built
    first, when they are not in the cache)."""
    assets = build_assets()
    report = json.loads(assets.warm_start_report.read_text())
    problem = Problem(37, 48, 86)
    print(f"  task: {problem.question()} -> {problem.answer()}, sums of {AssetSpec.digits}-digit numbers, with a calculator to call:")
    print(f"    {call_text(problem)}</s> <|tool|><tool_response>{problem.a + problem.b}</tool_response><|assistant|> {problem.answer()}</s>")
    print("    (the tool's message and the next <|assistant|> are verl's tool agent loop's: mask 0, not trained)")
    print("  reward on the last token, of the answer after the tool's: 1.0 fully right; else 0.2 right sum + 0.2 right verdict")
    settings, held_out = report["settings"], report["held_out"]
    print(
        f"  warm start ({settings['steps']} supervised steps; tool prior {settings['tool_prior']}, verdict prior "
        f"{settings['verdict_prior']}): held out, it calls the tool with probability {held_out['call_probability']:.2f};"
        f" greedy sum right {held_out['tool_sum']:.2f} through the tool, {held_out['head_sum']:.2f} from its head"
    )
    critic = json.loads(assets.value_pretraining_report.read_text())
    fit, paths = critic["held_out_fit"], critic["after_decision"]
    print(
        f"  critic pretrained on the warm start's own rollouts ({critic['updates']} updates): held-out explained variance "
        f"{_ev(fit['ev_first_token'])} at the first token, {_ev(fit['ev_after_decision'])} once the call decision is made, "
        f"{_ev(fit['ev_after_tool'])} after the tool's answer (at most {_ev(critic['ev_ceiling_after_tool'])} for any critic: "
        f"the verdict is still to be sampled), {_ev(fit['ev_after_verdict'])} after the verdict;"
    )
    print(
        f"    value once it has called {paths['call']['mean_value']:.2f} (return {paths['call']['mean_return']:.2f}), "
        f"once it has answered at once {paths['answer']['mean_value']:.2f} (return {paths['answer']['mean_return']:.2f})"
    )
