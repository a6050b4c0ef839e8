"""writer.py: publishing, the run record, resume, failures, the bounded queue."""

from __future__ import annotations

import dataclasses
import json
import threading
import warnings
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
import pytest

from tests.inspect.inspect_helpers import good_trace
from tests.trace.helpers import MASK, Gate, HookedMemoryFileSystem, fail_writes_to, make_capture, reference_rows, run_record
from verl_ext.errors import TraceError, UsageError
from verl_ext.options import TraceOptions
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import SCHEMA_VERSION, RunRecord, StepEntry
from verl_ext.trace.writer import TraceWriter

RUN_FIELDS = {
    "verl_ext_version": "0.1.0",
    "verl_version": "0.9.1",
    "trainer": "legacy",
    "created_at": "2025-01-01T00:00:00+00:00",
    "algorithm": {"adv_estimator": "mc", "gamma": 1.0, "lam": 1.0, "whiten_advantages": True},
    "model_path": "tiny",
    "tokenizer_path": "tiny",
    "rollout_n": 2,
    "trace": TraceOptions(dir="x").as_dict(),
    "update": {"actor": {"loss_mode": "vanilla", "loss_agg_mode": "token-mean"}},
    "host": "trainer-node-0",
    "node": None,
    "finished": False,
    "planned_steps": 40,
    "rollout": {"name": "vllm", "version": "0.27.0+cpu", "dtype": "float32"},
    "replay": None,  # a run's trace is no replay (verl_ext.apps.replay writes one)
    "config": {"trainer": {"default_local_dir": "checkpoints"}},
    "mode": None,  # how the trainer overlapped generation and training: not said (a synchronous run)
}
RUN_RECORD = RunRecord(**RUN_FIELDS)


def write(directory: str, captures, **options) -> None:
    with TraceWriter(TraceOptions(dir=directory, **options), RUN_RECORD) as writer:
        for capture in captures:
            writer.submit(capture)


def finished_on_disk(directory) -> bool | None:
    return json.loads((Path(directory) / "_run.json").read_text())["finished"]


def test_the_run_record_says_finished_only_after_finish(tmp_path, hooked_url):
    """finished stays as the run started it (False) through every step and a close; finish() makes it
    True, written after the steps submitted before it (the trainer calls it once fit() returned)."""
    unfinished, finished = tmp_path / "unfinished", tmp_path / "finished"
    with TraceWriter(TraceOptions(dir=str(unfinished)), RUN_RECORD) as writer:
        writer.submit(make_capture(1))
        writer.flush()
        assert finished_on_disk(unfinished) is False
        writer.submit(make_capture(2, seed=2))
    assert finished_on_disk(unfinished) is False  # closed without finish(): a run that stopped early
    gate = Gate("step-2/part-0.parquet")
    HookedMemoryFileSystem.on_write = gate
    with TraceWriter(TraceOptions(dir=hooked_url), RUN_RECORD) as writer:
        writer.submit(make_capture(1))
        writer.submit(make_capture(2, seed=2))  # held at its token file until the gate opens
        writer.finish()
        assert gate.reached.wait(timeout=30)
        record = json.loads(HookedMemoryFileSystem().cat_file(f"{hooked_url}/_run.json"))
        assert record["finished"] is False and list(record["steps"]) == ["1"]  # not before step 2
        gate.open()
    record = json.loads(HookedMemoryFileSystem().cat_file(f"{hooked_url}/_run.json"))
    assert record["finished"] is True and list(record["steps"]) == ["1", "2"]
    with TraceWriter(TraceOptions(dir=str(finished)), RUN_RECORD) as writer:
        writer.submit(make_capture(1))
        writer.finish()
    assert finished_on_disk(finished) is True
    assert open_trace(str(finished)).record.finished is True
    with pytest.raises(UsageError, match=r"finish\(\) called after close\(\)"):
        writer.finish()


def rows_of(directory: str, step: int) -> list[dict]:
    table = open_trace(directory).read_step(step).drop_columns(["step"])
    return table.to_pylist()


def test_steps_and_run_record(tmp_path):
    directory = str(tmp_path / "trace")
    record_given = RunRecord(**json.loads(json.dumps(RUN_FIELDS)))
    captures = [make_capture(step, seed=step) for step in (2, 4)]
    started = datetime.now(timezone.utc)
    with TraceWriter(TraceOptions(dir=directory, max_samples_per_step=4), record_given) as writer:
        for capture in captures:
            writer.submit(capture)
    assert record_given == RUN_RECORD  # the caller's dict is not modified

    record = json.loads((tmp_path / "trace" / "_run.json").read_text())
    assert {k: v for k, v in record.items() if k not in ("schema_version", "steps")} == RUN_FIELDS
    assert record["schema_version"] == SCHEMA_VERSION
    assert list(record["steps"]) == ["2", "4"]
    for capture in captures:
        entry = record["steps"][str(capture.step)]
        assert tuple(entry) == tuple(field.name for field in dataclasses.fields(StepEntry))
        assert entry["rows"] == len(reference_rows(capture, 4)) == 3 + 5 + 0 + 6
        assert (entry["samples"], entry["batch_samples"], entry["kl_coef"]) == (4, len(MASK), 0.05)
        assert entry["file"] == f"step-{capture.step}/part-0.parquet"
        assert entry["prompts_file"] == f"_prompts/step-{capture.step}.parquet"
        assert (tmp_path / "trace" / entry["file"]).is_file() and (tmp_path / "trace" / entry["prompts_file"]).is_file()
        written_at = datetime.fromisoformat(entry["written_at"])
        assert written_at.utcoffset() == timedelta(0) and started - timedelta(seconds=1) <= written_at <= datetime.now(timezone.utc)
        raw = capture.floats["advantage_raw"][capture.mask.bool()].double()  # all 5 samples, not the 4 kept
        assert entry["whiten"]["mean"] == pytest.approx(raw.mean().item(), rel=1e-6)
        assert entry["whiten"]["var"] == pytest.approx(raw.var().item(), rel=1e-6)
        assert rows_of(directory, capture.step) == reference_rows(capture, 4)


def test_only_published_files_remain(tmp_path):
    write(str(tmp_path), [make_capture(1), make_capture(2)])
    files = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*") if path.is_file())
    assert files == ["_prompts/step-1.parquet", "_prompts/step-2.parquet", "_run.json", "step-1/part-0.parquet", "step-2/part-0.parquet"]


def test_a_clean_trace_keeps_no_tmp_directory(tmp_path):
    trace = Path(good_trace(tmp_path / "trace"))
    assert sorted(p.name for p in trace.iterdir()) == ["_prompts", "_run.json", "step-1", "step-2", "step-3"]


def test_resume_replaces_a_retraced_step_and_keeps_the_others(tmp_path):
    directory = str(tmp_path)
    write(directory, [make_capture(step, seed=step) for step in (1, 2, 3)])
    first_record = json.loads((tmp_path / "_run.json").read_text())

    retraced = make_capture(3, mask=[[1, 1, 1, 1, 1, 1]] * 2, seed=99)
    resumed_record = dataclasses.replace(RUN_RECORD, created_at="2025-01-02T00:00:00+00:00")
    with TraceWriter(TraceOptions(dir=directory), resumed_record) as writer:
        writer.submit(retraced)
        writer.submit(make_capture(4, seed=4))

    trace = open_trace(directory)
    assert trace.steps == [1, 2, 3, 4]
    assert trace.record.created_at == "2025-01-02T00:00:00+00:00"
    assert dataclasses.asdict(trace.record.steps["1"]) == first_record["steps"]["1"]
    assert trace.record.steps["3"].rows == 12 != first_record["steps"]["3"]["rows"]
    assert rows_of(directory, 3) == reference_rows(retraced)
    assert trace.prompts(3).num_rows == 2
    by_step = ds.dataset(directory, format="parquet").to_table().group_by("step").aggregate([("sample", "count")])
    assert dict(zip(*by_step.to_pydict().values())) == {1: 17, 2: 17, 3: 12, 4: 17}


def test_resume_warns_when_the_algorithm_changed(tmp_path):
    write(str(tmp_path), [make_capture(1)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TraceWriter(TraceOptions(dir=str(tmp_path)), RUN_RECORD).close()  # same settings: silent
    changed = dataclasses.replace(RUN_RECORD, algorithm={**RUN_FIELDS["algorithm"], "gamma": 0.99})
    with pytest.warns(UserWarning, match=r"gamma: 1\.0 -> 0\.99"):
        TraceWriter(TraceOptions(dir=str(tmp_path)), changed).close()


def test_resume_refuses_another_schema_version(tmp_path):
    (tmp_path / "_run.json").write_text(json.dumps({"schema_version": SCHEMA_VERSION + 1, "steps": {}}))
    with pytest.raises(TraceError, match="schema version"):
        TraceWriter(TraceOptions(dir=str(tmp_path)), RUN_RECORD)


def test_unwritable_dir_is_refused_before_training(tmp_path, hooked_url):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UsageError, match=rf"trace dir {blocker}/trace is not writable: ") as error:
        TraceWriter(TraceOptions(dir=str(blocker / "trace")), RUN_RECORD)
    assert "\n" not in str(error.value)

    with pytest.raises(UsageError, match="trace dir nosuchprotocol://x is not writable: "):
        TraceWriter(TraceOptions(dir="nosuchprotocol://x"), RUN_RECORD)

    HookedMemoryFileSystem.on_write = fail_writes_to("", "permission denied (injected)")
    with pytest.raises(UsageError, match=rf"trace dir {hooked_url} is not writable: permission denied"):
        TraceWriter(TraceOptions(dir=hooked_url), RUN_RECORD)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"every": -1}, "every must be an integer >= 1"),
        ({"queue_size": 0}, "queue_size must be an integer >= 1"),
        ({"on_error": "ignore"}, "on_error must be 'warn' or 'raise'"),
        ({"max_samples_per_step": 2.5}, "max_samples_per_step must be an integer >= 1"),
    ],
)
def test_bad_options_cannot_even_be_made(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        TraceOptions(**{"dir": str(tmp_path), **options})


def test_a_writer_needs_a_dir():
    with pytest.raises(UsageError, match="dir is not set"):
        TraceWriter(TraceOptions(), RUN_RECORD)


def test_run_record_must_be_json(tmp_path):
    with pytest.raises(UsageError, match="run record is not JSON"):
        TraceWriter(TraceOptions(dir=str(tmp_path)), dataclasses.replace(RUN_RECORD, model_path=object()))


def test_failed_write_warns_and_training_goes_on(hooked_url):
    HookedMemoryFileSystem.on_write = fail_writes_to("step-2/part-0.parquet")
    writer = TraceWriter(TraceOptions(dir=hooked_url), RUN_RECORD)
    # Reported at the first submit after the failure, or at close if it comes later.
    with pytest.warns(RuntimeWarning, match=r"writing step 2 to .* failed: disk full \(injected\); training goes on") as caught:
        for step in (1, 2, 3):
            writer.submit(make_capture(step))
        writer.close()
    assert len([w for w in caught if "writing step" in str(w.message)]) == 1
    trace = open_trace(hooked_url)
    assert trace.steps == [1, 3] and sorted(trace.record.steps) == ["1", "3"]
    fs = HookedMemoryFileSystem()
    assert not fs.exists(fs._strip_protocol(hooked_url) + "/_tmp")  # the partial file was removed, then _tmp/


def test_failed_write_raises_at_the_next_submit(hooked_url):
    # step 2's write waits at its own gate until step 3 is submitted: on a busy machine the
    # writer thread could otherwise fail step 2 before submit(3), which would then raise
    held, fail, gate = Gate("step-2/part-0.parquet"), fail_writes_to("step-2/part-0.parquet"), Gate("step-3/part-0.parquet")

    def hook(path):
        held(path)
        fail(path)
        gate(path)

    HookedMemoryFileSystem.on_write = hook
    writer = TraceWriter(TraceOptions(dir=hooked_url, on_error="raise"), RUN_RECORD)
    writer.submit(make_capture(1))
    writer.submit(make_capture(2))
    writer.submit(make_capture(3))
    held.open()
    assert gate.reached.wait(10)  # step 2 has failed: the thread is at step 3 now
    with pytest.raises(TraceError, match=r"writing step 2 of the trace to .* failed: disk full") as error:
        writer.submit(make_capture(4))
    assert "\n" not in str(error.value) and isinstance(error.value.__cause__, OSError)
    gate.open()
    writer.close()  # the failure was reported once; nothing else failed
    writer.close()  # idempotent
    assert open_trace(hooked_url).steps == [1, 3]
    with pytest.raises(UsageError, match="after close"):
        writer.submit(make_capture(5))


def test_failed_write_raises_at_close(hooked_url):
    HookedMemoryFileSystem.on_write = fail_writes_to("_prompts/step-2.parquet")
    writer = TraceWriter(TraceOptions(dir=hooked_url, on_error="raise"), RUN_RECORD)
    writer.submit(make_capture(1))
    writer.submit(make_capture(2))
    with pytest.raises(TraceError, match="writing step 2"):
        writer.close()
    writer.close()
    assert open_trace(hooked_url).steps == [1]


def test_failed_retrace_leaves_the_old_step_readable(hooked_url):
    old = make_capture(2, seed=1)
    write(hooked_url, [old])
    HookedMemoryFileSystem.on_write = fail_writes_to("step-2/part-0.parquet")
    with pytest.warns(RuntimeWarning, match="writing step 2 .* failed"):
        write(hooked_url, [make_capture(2, mask=[[1] * 6] * 3, seed=2)])
    assert rows_of(hooked_url, 2) == reference_rows(old)
    # The new prompt file went in before the token file failed: the reader refuses the mixed pair.
    with pytest.raises(TraceError, match="prompt table of step 2 comes from another write"):
        open_trace(hooked_url).prompts(2)


def test_failed_prompt_write_leaves_the_old_step_whole(hooked_url):
    old = make_capture(2, seed=1)
    write(hooked_url, [old])
    HookedMemoryFileSystem.on_write = fail_writes_to("_prompts/step-2.parquet")
    with pytest.warns(RuntimeWarning, match="writing step 2 .* failed"):
        write(hooked_url, [make_capture(2, seed=2)])
    trace = open_trace(hooked_url)
    assert rows_of(hooked_url, 2) == reference_rows(old)
    assert trace.prompts(2).column("prompt_token_ids").to_pylist()[0] == [
        int(p) for p, real in zip(old.prompts[0], old.prompt_mask[0]) if real
    ]


def test_failed_record_update_keeps_the_step_and_its_entry(hooked_url):
    writer = TraceWriter(TraceOptions(dir=hooked_url), RUN_RECORD)
    HookedMemoryFileSystem.on_write = fail_writes_to("_run.json")
    writer.submit(make_capture(1))
    with pytest.warns(RuntimeWarning, match=r"writing step 1 .* failed: the step is in the trace but _run.json was not updated"):
        writer.close()
    trace = open_trace(hooked_url)
    assert trace.steps == [1] and trace.record.steps == {}
    assert trace.step_record(1).rows == len(reference_rows(make_capture(1)))


def test_invalid_capture_warns_or_raises_at_submit(tmp_path):
    bad = make_capture(5)
    bad.floats["value"] = bad.floats["value"][:, :2]
    with TraceWriter(TraceOptions(dir=str(tmp_path / "warn")), RUN_RECORD) as writer:
        with pytest.warns(RuntimeWarning, match=r"writing step 5 .* failed: value has shape"):
            writer.submit(bad)
        not_a_tensor = make_capture(7)
        not_a_tensor.floats["return"] = [[0.0] * 6] * 5
        with pytest.warns(RuntimeWarning, match=r"writing step 7 .* failed"):
            writer.submit(not_a_tensor)
        writer.submit(make_capture(6))
    assert open_trace(str(tmp_path / "warn")).steps == [6]
    with TraceWriter(TraceOptions(dir=str(tmp_path / "raise"), on_error="raise"), RUN_RECORD) as writer:
        with pytest.raises(TraceError, match="value has shape"):
            writer.submit(bad)


def test_submit_blocks_only_when_the_queue_is_full(hooked_url):
    gate = Gate("step-1/part-0.parquet")
    HookedMemoryFileSystem.on_write = gate
    writer = TraceWriter(TraceOptions(dir=hooked_url, queue_size=1), RUN_RECORD)
    writer.submit(make_capture(1))
    assert gate.reached.wait(10)  # step 1 is being written
    writer.submit(make_capture(2))  # fills the queue, returns at once
    third = threading.Thread(target=writer.submit, args=(make_capture(3),))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # blocked on the full queue
    gate.open()
    third.join(10)
    assert not third.is_alive()
    writer.close()
    assert open_trace(hooked_url).steps == [1, 2, 3]


def test_recycled_memory_does_not_change_a_step_being_written(hooked_url):
    gate = Gate("step-1/part-0.parquet")  # step 1's tables are built, its memory given back
    HookedMemoryFileSystem.on_write = gate
    first, second = make_capture(1, seed=1), make_capture(2, mask=[[1] * 6] * 5, seed=2)
    expected = {1: reference_rows(first), 2: reference_rows(second)}  # before the writer holds them
    writer = TraceWriter(TraceOptions(dir=hooked_url), RUN_RECORD)
    writer.submit(first)
    assert gate.reached.wait(10)
    writer.submit(second)  # copies into the block step 1 used
    gate.open()
    writer.close()
    assert expected[1] != expected[2]  # step 2's data in step 1's file would show
    assert rows_of(hooked_url, 1) == expected[1]
    assert rows_of(hooked_url, 2) == expected[2]


def test_exception_in_the_with_block_is_not_hidden(hooked_url):
    """The trainer's exception leaves the with block as raised, the very object, even with
    on_error="raise" and a failed step: the failure becomes a warning that names the step, and the
    other steps are written in full."""
    HookedMemoryFileSystem.on_write = fail_writes_to("step-2/part-0.parquet")
    first, error = make_capture(1), KeyError("from the trainer")
    expected = reference_rows(first)
    with pytest.raises(KeyError) as raised, pytest.warns(RuntimeWarning) as caught:
        with TraceWriter(TraceOptions(dir=hooked_url, on_error="raise"), RUN_RECORD) as writer:
            writer.submit(first)
            writer.submit(make_capture(2, seed=2))
            raise error
    assert raised.value is error and raised.value.__context__ is None  # not chained to the writer's failure
    failures = [str(w.message) for w in caught if "failed" in str(w.message)]
    assert len(failures) == 1 and "writing step 2" in failures[0] and "disk full (injected)" in failures[0]
    assert open_trace(hooked_url).steps == [1] and rows_of(hooked_url, 1) == expected


def test_a_failed_step_leaves_no_prompt_table_behind(hooked_url):
    HookedMemoryFileSystem.on_write = fail_writes_to("step-2/part-0.parquet")
    with pytest.warns(RuntimeWarning, match="writing step 2"):
        with TraceWriter(TraceOptions(dir=hooked_url), run_record()) as writer:
            for step in (1, 2):
                writer.submit(make_capture(step))
    fs = HookedMemoryFileSystem()
    prompts = fs.ls(fs._strip_protocol(hooked_url) + "/_prompts", detail=False)
    assert [p.rsplit("/", 1)[1] for p in prompts] == ["step-1.parquet"]


def test_with_on_error_raise_the_exit_warning_does_not_promise_training_goes_on(hooked_url):
    HookedMemoryFileSystem.on_write = fail_writes_to("step-1/part-0.parquet")
    with pytest.raises(KeyError), pytest.warns(RuntimeWarning) as caught:
        with TraceWriter(TraceOptions(dir=hooked_url, on_error="raise"), run_record()) as writer:
            writer.submit(make_capture(1))
            raise KeyError("from the trainer")
    messages = [str(w.message) for w in caught]
    assert any("writing step 1" in m and "reported when the trace closed" in m for m in messages)
    assert not any("training goes on" in m for m in messages)


def test_stale_temporaries_are_cleared(tmp_path):
    (tmp_path / "_tmp").mkdir()
    (tmp_path / "_tmp" / "step-3~part-0.parquet.dead.tmp").write_bytes(b"partial")
    TraceWriter(TraceOptions(dir=str(tmp_path)), RUN_RECORD).close()
    assert not (tmp_path / "_tmp").exists()


def test_update_tables_from_several_ranks_are_sorted_and_truncated_like_the_token_table(tmp_path):
    from verl_ext.trace.update_files import UpdateCapture

    def report(rank, samples, epoch):
        count = len(samples)
        return {
            "epoch": epoch, "minibatch": 0, "microbatch": 0, "rank": rank, "batch_num_tokens": 4,
            "global_batch_size": 4, "dp_size": 2,
            "columns": {
                "sample": np.array(samples, np.int32), "token_index": np.zeros(count, np.int32),
                "vpred": np.arange(count, dtype=np.float32) + rank, "vf_clipped": np.zeros(count, bool),
            },
        }  # fmt: skip

    directory = str(tmp_path / "t")
    with TraceWriter(TraceOptions(dir=directory, max_samples_per_step=3), RUN_RECORD) as writer:
        writer.submit(make_capture(1))
        parts = [report(1, [3, 2], 1), report(0, [1, 0], 1), report(1, [3, 2], 0), report(0, [1, 0], 0)]
        writer.submit_update(UpdateCapture(1, "critic", parts, {"critic/vf_loss": 0.5}))
    trace = open_trace(directory)
    table = trace.critic_update(1).to_pydict()
    assert list(zip(table["epoch"], table["sample"], table["rank"])) == [
        (0, 0, 0), (0, 1, 0), (0, 2, 1), (1, 0, 0), (1, 1, 0), (1, 2, 1)
    ]  # sample 3 is past max_samples_per_step, as in the token table
    assert table["vpred"] == [1.0, 0.0, 2.0, 1.0, 0.0, 2.0] and table["vf_loss"] == [None] * 6
    assert trace.record.steps["1"].updates["critic"].logged == {"critic/vf_loss": 0.5}
    with pytest.raises(TraceError, match="no actor update table for step 1"):
        trace.actor_update(1)


def test_policy_versions_and_the_steps_place_in_verls_loop_are_written_and_read_back(tmp_path):
    """Format 11: each response's (min, max) policy version in the prompt table, null where the rollout said
    none; the step's verl step, sub-step and trainer version in its entry; a run record's mode as given."""
    directory = str(tmp_path / "trace")
    capture = make_capture(3, seed=1)
    versions = [(2, 2), (1, 2), (None, None), (2, 3), (0, 1)]  # one per sample of MASK
    capture = dataclasses.replace(capture, policy_versions=versions, global_step=2, substep=1, trainer_version=3)
    mode = {"name": "separate_async", "parameter_sync_step": 2}
    with TraceWriter(TraceOptions(dir=directory), dataclasses.replace(RUN_RECORD, mode=mode)) as writer:
        writer.submit(capture)
    trace = open_trace(directory)
    prompts = trace.prompts(3).to_pydict()
    kept = len(prompts["sample"])
    assert list(zip(prompts["policy_version_min"], prompts["policy_version_max"])) == versions[:kept]
    entry = trace.step_record(3)
    assert (entry.global_step, entry.substep, entry.trainer_version) == (2, 1, 3) and trace.record.mode == mode
