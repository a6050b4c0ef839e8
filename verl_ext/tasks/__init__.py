"""Example tasks for the CPU backend, each built locally (no download): :mod:`.arith` (the default)
and :mod:`.tool` (the same question, with a calculator the policy may call through verl's tool
agent loop).

A task is one package and one :class:`Task` record in :data:`TASKS`; the apps look a task up by its
name (:func:`get_task`) and read everything they need from the record, never from its name. What
every task's assets are built with (the cache, the tokenizer, the model, the fine-tune) is
:mod:`.common`.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from verl_ext.tasks.arith.task import VERDICT_MARK
from verl_ext.tasks.tool.task import CALL_START


@dataclass(frozen=True)
class Task:
    """What the apps need of an example task. Its building code (torch, transformers) is imported
    when first used, not when the task is looked up."""

    name: str
    #: What it asks, in one line (the command line's help).
    summary: str
    #: The module that builds its assets: ``build_assets(cache_dir)``, ``AssetSpec``, ``describe()``,
    #: and ``tokenizer_function``, which builds its tokenizer.
    assets_module: str
    tokenizer_function: str
    #: The training steps and the estimator of the demo when none is given.
    steps: int
    estimator: str
    #: Whether the assets hold a value-pretrained critic (``critic_dir``) for verl's critic to start from.
    pretrained_critic: bool
    #: The verdict, the decision the credit lines follow, is the token after the first of these.
    verdict_mark: str
    #: The first token of a tool call, when a response may start with one (its other decision), else None.
    call_token: str | None = None

    def build_assets(self, cache_dir=None):
        """Its assets in ``cache_dir`` (default: the shared cache), built once and cached
        (:class:`verl_ext.cpu.overrides.RunAssets`)."""
        return self._assets().build_assets(cache_dir)

    def asset_spec(self):
        """The spec its assets are built from by default (``val_problems``: verl's validation prompts)."""
        return self._assets().AssetSpec()

    def tokenizer(self):
        """The tokenizer its assets are saved with, built without them."""
        return getattr(self._assets(), self.tokenizer_function)()

    def describe(self) -> None:
        """Print the task and its warm start from the built assets (the demo, before training)."""
        self._assets().describe()

    def _assets(self):
        return importlib.import_module(self.assets_module)


DEFAULT_TASK = "arith"
TASKS = {
    task.name: task
    for task in (
        Task("arith", "请问a+b=c？ with digits a and b: the sum, then the verdict",
             "verl_ext.tasks.arith.assets", "build_tokenizer",
             steps=40, estimator="mc", pretrained_critic=True, verdict_mark=VERDICT_MARK),  # fmt: skip
        Task("tool", "the same question with a calculator the policy may call through verl's tool agent loop",
             "verl_ext.tasks.tool.assets", "build_tool_tokenizer",
             steps=25, estimator="turn_gae", pretrained_critic=True, verdict_mark=VERDICT_MARK, call_token=CALL_START),  # fmt: skip
    )
}


def get_task(name: str) -> Task:
    """The task named ``name`` (:data:`TASKS`)."""
    if name not in TASKS:
        from verl_ext.errors import UsageError

        raise UsageError(f"unknown task {name!r}; the tasks are: {', '.join(TASKS)}")
    return TASKS[name]
