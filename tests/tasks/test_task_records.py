"""The task records (verl_ext.tasks.TASKS): a name that is no task is refused with the valid ones,
each record's tokenizer has its decision tokens as single tokens, and the apps read a task's
record, never its name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from verl_ext.errors import UsageError
from verl_ext.tasks import DEFAULT_TASK, TASKS, get_task

APPS = Path(__file__).resolve().parents[2] / "verl_ext" / "apps"


def test_an_unknown_task_is_refused_with_the_names_of_the_tasks():
    with pytest.raises(UsageError, match="unknown task 'chess'; the tasks are: arith, tool"):
        get_task("chess")
    assert get_task(DEFAULT_TASK) is TASKS["arith"]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_decision_tokens_are_single_tokens_of_the_tasks_tokenizer(name):
    task = TASKS[name]
    tokenizer = task.tokenizer()
    for token in filter(None, (task.verdict_mark, task.call_token)):
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
        assert tokenizer.convert_tokens_to_ids(token) != tokenizer.unk_token_id
    assert task.asset_spec().val_problems > 0


def test_no_app_branches_on_a_task_name():
    """A comparison with a task's name in the apps would be a branch a new task has to edit."""
    found = []
    for path in sorted(APPS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                names = {c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)} & set(TASKS)
                found += [f"{path.name}:{node.lineno}" for _ in names]
    assert found == []
