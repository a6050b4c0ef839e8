"""``verl-ext replay`` of one update of an asynchronous run (docs/inspecting.md#replaying-a-step), on synthetic
format-11 traces (tests/inspect/staleness_helpers.py: no training). Model-free, any trace step replays, a
V1 separate_async sub-step included, and the report says where the update sits and the mode. With the model,
the checkpoint the update starts from is the one verl saved of the weights it starts from, by the rules of
each mode written out by hand below (docs/cpu_backend.md: verl names a checkpoint by its own step, fully async
by weight version); an update none holds is one line, exit 2, saying why.
"""

from __future__ import annotations

import json

import pytest

from tests.inspect.inspect_helpers import good_trace
from tests.inspect.staleness_helpers import PLACES, SEPARATE_ASYNC, async_trace
from verl_ext.apps import replay_model
from verl_ext.errors import ReplayError


@pytest.fixture(scope="module")
def separate_async(tmp_path_factory) -> str:
    """PLACES (three verl steps of two updates each), with a recorded config naming a checkpoint directory
    whose global_step_1 and global_step_2 exist (empty: nothing here loads them)."""
    directory = tmp_path_factory.mktemp("async")
    path = async_trace(directory / "trace")
    for step in (1, 2):
        (directory / "checkpoints" / f"global_step_{step}").mkdir(parents=True)
    record = json.loads((directory / "trace" / "_run.json").read_text())
    record["config"] = {"trainer": {"default_local_dir": str(directory / "checkpoints"), "device": "cpu"}}
    (directory / "trace" / "_run.json").write_text(json.dumps(record))
    return path


def place_line(step: int) -> str:
    global_step, substep, version, _ = PLACES[step]
    return (f"the update: verl step {global_step}, update {substep + 1} of 2, trainer version {version}; "
            "mode separate_async (parameter_sync_step=2)")  # fmt: skip


@pytest.mark.parametrize("step", sorted(PLACES))
def test_every_update_replays_model_free_and_says_where_it_sits(separate_async, run_cli, step):
    code, out, err = run_cli("replay", separate_async, "--step", str(step), "--model-free")
    assert code == 0 and err == "" and out.splitlines()[1] == place_line(step)
    assert "as recorded: REPRODUCED" in out
    code, out, _ = run_cli("replay", separate_async, "--step", str(step), "--model-free", "--format", "json")
    assert code == 0 and json.loads(out)["update"] == place_line(step).removeprefix("the update: ")


def test_a_later_update_of_a_step_is_refused_with_the_model(separate_async, run_cli, tmp_path):
    """Update 2 of verl's step 2 starts from the weights after its first update, which no checkpoint holds: with
    --checkpoint, one line and exit 2; without, the replay goes model-free and says why; its replay's trace
    keeps the update's place."""
    checkpoints = str(separate_async).replace("/trace", "/checkpoints")
    code, out, err = run_cli("replay", separate_async, "--step", "4", "--checkpoint", checkpoints)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert ("step 4 is verl step 2, update 2 of 2, trainer version 1 (separate_async (parameter_sync_step=2)): update 2 of verl's step 2 "
            "starts from the weights after its 1 update(s) before it") in err and "--model-free" in err  # fmt: skip
    code, out, err = run_cli("replay", separate_async, "--step", "4")
    assert code == 0 and "as recorded: REPRODUCED" in out
    assert err.startswith("note: step 4 is verl step 2, update 2 of 2") and err.strip().endswith(": model-free")
    assert not replay_model.has_checkpoint_for(replay_model.checkpoint_root(_open(separate_async), None), 4, _open(separate_async))
    out = tmp_path / "replayed"  # its replay as a trace: the step's entry keeps its place, the record its mode
    code, _, _ = run_cli("replay", separate_async, "--step", "4", "--model-free", "--out", str(out))
    assert code == 0
    entry = _open(str(out)).step_record(4)
    assert (entry.global_step, entry.substep, entry.trainer_version) == PLACES[4][:3] and _open(str(out)).record.mode == SEPARATE_ASYNC


def _open(path):
    from verl_ext.trace.reader import open_trace

    return open_trace(path)


def test_which_checkpoints_each_mode_starts_from(tmp_path):
    """By hand, from how verl names its checkpoints: separate_async (2 updates a step): verl step g's first update
    from global_step_<g−1> (none for g = 1: the config's model), nothing right after it (global_step_<g> is after
    both); one-step-off: step n from global_step_<n−1> to global_step_<n>; fully async, a sync per update
    (sub-step None): version v's update from global_step_<v> to global_step_<v+1>; with two updates per sync, the
    first from global_step_<v>, nothing after it, the second refused."""
    separate = _open(async_trace(tmp_path / "separate", updates=False))
    expected = {1: (1, None, None), 3: (2, 1, None), 5: (3, 2, None)}  # step -> (verl step, before, after)
    for step, (verl_step, before, after) in expected.items():
        got = replay_model.update_checkpoints(separate, step)
        assert (got.verl_step, got.before, got.after) == (verl_step, before, after)
        assert got.why_no_after == f"verl's checkpoint of step {verl_step} holds the weights after all 2 of its updates"
    for step in (2, 4, 6):
        with pytest.raises(ReplayError, match=f"update 2 of verl's step {PLACES[step][0]} starts from the weights after"):
            replay_model.update_checkpoints(separate, step)
    one_step_off = {n: (n, None, n - 1 if n > 1 else None, [(max(n - 1, 0), max(n - 1, 0))] * 6) for n in (1, 2, 3)}
    trace = _open(async_trace(tmp_path / "one_step_off", one_step_off, mode={"name": "one_step_off"}, updates=False))
    assert [(c.before, c.after) for c in map(lambda n: replay_model.update_checkpoints(trace, n), (1, 2, 3))] == [(None, 1), (1, 2), (2, 3)]
    fully = {n: (n, None, n - 1, [(n - 1, n - 1)] * 6) for n in (1, 2, 3)}
    trace = _open(async_trace(tmp_path / "fully", fully, mode={"name": "fully_async", "trigger_parameter_sync_step": 1}, updates=False))
    assert [(c.before, c.after) for c in map(lambda n: replay_model.update_checkpoints(trace, n), (1, 2, 3))] == [(None, 1), (1, 2), (2, 3)]
    cycles = {1: (1, 0, 0, [(0, 0)] * 6), 2: (2, 1, 0, [(0, 0)] * 6), 3: (3, 0, 1, [(0, 1)] * 6), 4: (4, 1, 1, [(1, 1)] * 6)}
    trace = _open(async_trace(tmp_path / "cycles", cycles, mode={"name": "fully_async", "trigger_parameter_sync_step": 2}, updates=False))
    third = replay_model.update_checkpoints(trace, 3)
    assert (third.before, third.after, third.why_no_after) == (1, None, "global_step_2 holds the weights after every update of version 1")
    with pytest.raises(ReplayError, match=r"^step 4 is verl step 4, update 2 of the 2 of trainer version 1 \(fully_async \(trigger_parameter_sync_step=2\)\): "
                       "update 2 of version 1 starts from the weights after its 1 update.*global_step_<version>"):
        replay_model.update_checkpoints(trace, 4)


def test_a_synchronous_replay_reports_as_before(tmp_path, run_cli):
    """No line about the update's place, no key of it in the JSON (the worked example of test_inspect_update.py),
    and its checkpoints those of step n − 1 and n."""
    from tests.inspect.test_inspect_update import hand_trace

    path = hand_trace(tmp_path / "t")
    code, out, _ = run_cli("replay", path, "--step", "1", "--model-free")
    assert code == 0 and "the update:" not in out
    code, out, _ = run_cli("replay", path, "--step", "1", "--model-free", "--format", "json")
    assert code == 0 and "update" not in json.loads(out)
    synchronous = _open(good_trace(tmp_path / "sync"))
    assert [(c.verl_step, c.before, c.after, c.place) for c in map(lambda n: replay_model.update_checkpoints(synchronous, n), (1, 2, 3))] == [
        (1, None, 1, None), (2, 1, 2, None), (3, 2, 3, None)
    ]
