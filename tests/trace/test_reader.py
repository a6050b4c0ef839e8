"""reader.py and the format itself: what open_trace and four standard readers see."""

from __future__ import annotations

import json
import shutil

import duckdb
import fsspec
import pandas
import polars
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from tests.trace.helpers import make_capture, reference_rows, rewrite_in_the_old_layout, run_record
from verl_ext.errors import StepFileError, TraceError, UsageError
from verl_ext.options import TraceOptions
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import PROMPT_SCHEMA, TOKEN_SCHEMA
from verl_ext.trace.writer import TraceWriter

STEPS = (1, 3, 10)  # 10 after 3: steps must sort as numbers, not as strings


def write_trace(directory: str) -> dict[int, list[dict]]:
    """Three steps; returns the expected rows of each, with the step column."""
    captures = [make_capture(step, seed=step) for step in STEPS]
    with TraceWriter(TraceOptions(dir=directory), run_record()) as writer:
        for capture in captures:
            writer.submit(capture)
    return {c.step: [{"step": c.step, **row} for row in reference_rows(c)] for c in captures}


@pytest.fixture(scope="module")
def local_trace(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("trace"))
    return directory, write_trace(directory)


def all_rows(expected: dict[int, list[dict]]) -> list[dict]:
    return [row for step in sorted(expected) for row in expected[step]]


def key_and_advantage(rows) -> list[tuple]:
    return sorted((int(r["step"]), int(r["sample"]), int(r["token_index"]), float(r["advantage"])) for r in rows)


def test_trace_object(local_trace):
    directory, expected = local_trace
    trace = open_trace(directory)
    assert trace.path == directory and trace.steps == list(STEPS)
    assert trace.record.trainer == "legacy"
    for step in STEPS:
        table = trace.read_step(step)
        assert table.schema.equals(TOKEN_SCHEMA)
        assert table.to_pylist() == expected[step]
        assert trace.step_record(step) == trace.record.steps[str(step)]
    assert [step for step, _ in trace.iter_steps()] == list(STEPS)
    assert trace.to_polars().to_dicts() == all_rows(expected)
    frame = trace.to_pandas(3)
    assert list(frame.columns) == TOKEN_SCHEMA.names and len(frame) == len(expected[3])


def test_column_selection_keeps_schema_order(local_trace):
    trace = open_trace(local_trace[0])
    table = trace.read_step(3, columns=["advantage", "step", "sample"])
    assert table.column_names == ["step", "sample", "advantage"]
    assert [name for name, _ in trace.iter_steps(["kl"])] == list(STEPS)
    only_step = trace.read_step(3, columns=["step"])
    assert only_step.column_names == ["step"] and only_step["step"].to_pylist() == [3] * trace.step_record(3).rows
    with pytest.raises(UsageError, match="unknown trace column"):
        trace.read_step(3, columns=["advantages"])


def test_prompts(local_trace):
    directory, _ = local_trace
    capture = make_capture(3, seed=3)
    table = open_trace(directory).prompts(3)
    assert table.schema.equals(PROMPT_SCHEMA)
    assert table.column("prompt_token_ids").to_pylist() == [
        [int(p) for p, real in zip(capture.prompts[i], capture.prompt_mask[i]) if real] for i in range(len(capture.uid))
    ]


def test_dataset(local_trace):
    directory, expected = local_trace
    dataset = open_trace(directory).dataset()
    assert dataset.schema.equals(TOKEN_SCHEMA, check_metadata=False)
    assert key_and_advantage(dataset.to_table().to_pylist()) == key_and_advantage(all_rows(expected))


# ------------------------------------------------------------------ the four readers, as documented in schema.py


def test_pyarrow_dataset_reads_the_directory(local_trace):
    directory, expected = local_trace
    table = ds.dataset(directory, format="parquet").to_table()
    assert key_and_advantage(table.to_pylist()) == key_and_advantage(all_rows(expected))


def test_pandas_reads_the_directory(local_trace):
    directory, expected = local_trace
    frame = pandas.read_parquet(directory)
    assert key_and_advantage(frame.to_dict("records")) == key_and_advantage(all_rows(expected))


def test_polars_reads_the_directory(local_trace):
    directory, expected = local_trace
    frame = polars.scan_parquet(directory + "/step-*/*.parquet").collect()
    assert key_and_advantage(frame.to_dicts()) == key_and_advantage(all_rows(expected))


def test_duckdb_reads_the_directory(local_trace):
    directory, expected = local_trace
    relation = duckdb.sql(f"select * from read_parquet('{directory}/step-*/*.parquet')")
    rows = [dict(zip(relation.columns, values)) for values in relation.fetchall()]
    assert key_and_advantage(rows) == key_and_advantage(all_rows(expected))


# ------------------------------------------------------------------ other filesystems


def test_memory_filesystem(memory_url):
    expected = write_trace(memory_url)
    trace = open_trace(memory_url)
    assert trace.steps == list(STEPS)
    assert trace.to_polars().to_dicts() == all_rows(expected)
    assert trace.prompts(10).num_rows == len(make_capture().uid)
    assert key_and_advantage(trace.dataset().to_table().to_pylist()) == key_and_advantage(all_rows(expected))

    fs, path = fsspec.core.url_to_fs(memory_url)
    table = ds.dataset(path, filesystem=fs, format="parquet").to_table()
    assert key_and_advantage(table.to_pylist()) == key_and_advantage(all_rows(expected))
    assert key_and_advantage(pandas.read_parquet(memory_url).to_dict("records")) == key_and_advantage(all_rows(expected))
    connection = duckdb.connect()
    connection.register_filesystem(fs)
    relation = connection.sql(f"select * from read_parquet('{memory_url}/step-*/*.parquet')")
    rows = [dict(zip(relation.columns, values)) for values in relation.fetchall()]
    assert key_and_advantage(rows) == key_and_advantage(all_rows(expected))


def test_filesystem_argument_and_file_url(local_trace):
    directory, _ = local_trace
    for trace in (
        open_trace(directory, filesystem=pafs.LocalFileSystem()),
        open_trace(directory, filesystem=fsspec.filesystem("file")),
        open_trace("file://" + directory),
    ):
        assert trace.steps == list(STEPS) and trace.read_step(1).num_rows > 0


# ------------------------------------------------------------------ errors: TraceError, one line


def one_line_trace_error(call) -> str:
    with pytest.raises(TraceError) as error:
        call()
    message = str(error.value)
    assert "\n" not in message
    return message


def test_open_errors(tmp_path):
    assert "does not exist" in one_line_trace_error(lambda: open_trace(str(tmp_path / "nope")))
    (tmp_path / "file").write_text("x")
    assert "not a directory" in one_line_trace_error(lambda: open_trace(str(tmp_path / "file")))
    assert "no _run.json" in one_line_trace_error(lambda: open_trace(str(tmp_path)))
    (tmp_path / "_run.json").write_text("{not json")
    assert "not readable JSON" in one_line_trace_error(lambda: open_trace(str(tmp_path)))
    (tmp_path / "_run.json").write_text(json.dumps({"schema_version": 999, "steps": {}}))
    assert "schema version 999 is not supported" in one_line_trace_error(lambda: open_trace(str(tmp_path)))
    (tmp_path / "_run.json").write_text(json.dumps({"steps": {}}))
    assert "schema version None" in one_line_trace_error(lambda: open_trace(str(tmp_path)))


@pytest.fixture
def fresh_trace(tmp_path):
    write_trace(str(tmp_path))
    return tmp_path


def test_opening_is_lazy_and_a_corrupt_file_fails_its_step_only(fresh_trace):
    (fresh_trace / "step-3" / "part-0.parquet").write_bytes(b"PAR1 this is not parquet")
    trace = open_trace(str(fresh_trace))  # reads only _run.json and the listing
    assert trace.steps == list(STEPS)
    assert "not a readable Parquet file" in one_line_trace_error(lambda: trace.read_step(3))
    assert "not a readable Parquet file" in one_line_trace_error(lambda: trace.step_record(3))
    assert trace.read_step(10).num_rows > 0


@pytest.mark.parametrize(
    ("damage", "file", "read"),
    [
        ("cut short", "step-3/part-0.parquet", lambda trace: trace.read_step(3)),
        ("cut short", "step-3/part-0.parquet", lambda trace: trace.step_record(3)),
        ("cut short", "_prompts/step-3.parquet", lambda trace: trace.prompts(3)),
        ("moved", "step-3/part-0.parquet", lambda trace: trace.read_step(3)),
        ("lacks a column", "step-3/part-0.parquet", lambda trace: trace.read_step(3)),
        ("removed", "_prompts/step-3.parquet", lambda trace: trace.prompts(3)),
    ],
)
def test_a_file_of_one_step_that_does_not_read_names_the_step_and_the_file(fresh_trace, damage, file, read):
    """What a command needs to leave the step out and go on: a StepFileError (a TraceError, so still one
    line for a caller that stops) with the step and the file relative to the trace; the other steps read."""
    path = fresh_trace / file
    if damage == "cut short":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "moved":
        shutil.copyfile(fresh_trace / "step-10" / "part-0.parquet", path)
    elif damage == "lacks a column":
        pq.write_table(pq.read_table(path).drop_columns(["value"]), path)
    else:
        path.unlink()
    trace = open_trace(str(fresh_trace))
    with pytest.raises(StepFileError) as raised:
        read(trace)
    assert (raised.value.step, raised.value.file) == (3, file) and isinstance(raised.value, TraceError)
    assert trace.read_step(10).num_rows > 0 and trace.prompts(1).num_rows > 0


def test_the_steps_the_run_record_lists_and_the_disk_lacks_are_missing(fresh_trace):
    assert open_trace(str(fresh_trace)).missing_steps == []
    shutil.rmtree(fresh_trace / "step-3")
    trace = open_trace(str(fresh_trace))
    assert trace.steps == [1, 10] and trace.missing_steps == [3]
    with pytest.raises(TraceError, match="has no step 3") as raised:  # asking for it is bad input, not a broken file
        trace.read_step(3)
    assert not isinstance(raised.value, StepFileError)


def test_missing_columns(fresh_trace):
    path = fresh_trace / "step-3" / "part-0.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["kl", "value"]), path)
    message = one_line_trace_error(lambda: open_trace(str(fresh_trace)).read_step(3))
    assert "lacks column(s) value, kl" in message


def test_file_of_another_schema_version(fresh_trace):
    path = fresh_trace / "step-3" / "part-0.parquet"
    table = pq.read_table(path)
    pq.write_table(table.replace_schema_metadata({"verl_ext.schema_version": "999"}), path)
    assert "schema version 999" in one_line_trace_error(lambda: open_trace(str(fresh_trace)).read_step(3))


def test_missing_step_and_missing_prompt_file(fresh_trace):
    trace = open_trace(str(fresh_trace))
    assert "has no step 2 (steps on disk: 1, 3, 10)" in one_line_trace_error(lambda: trace.read_step(2))
    (fresh_trace / "_prompts" / "step-3.parquet").unlink()
    assert "_prompts/step-3.parquet is missing" in one_line_trace_error(lambda: trace.prompts(3))


def test_a_step_directory_without_its_file_is_not_a_step(fresh_trace):
    (fresh_trace / "step-4").mkdir()
    (fresh_trace / "step-5").mkdir()
    (fresh_trace / "step-5" / ".part-0.parquet.partial").write_bytes(b"half")
    assert open_trace(str(fresh_trace)).steps == list(STEPS)
    assert ds.dataset(str(fresh_trace), format="parquet").to_table().num_rows == sum(
        open_trace(str(fresh_trace)).step_record(s).rows for s in STEPS
    )


def test_empty_trace(tmp_path):
    TraceWriter(TraceOptions(dir=str(tmp_path)), run_record()).close()
    trace = open_trace(str(tmp_path))
    assert trace.steps == [] and trace.to_pandas().empty and trace.dataset().to_table().num_rows == 0
    assert pa.concat_tables([t for _, t in trace.iter_steps()] or [TOKEN_SCHEMA.empty_table()]).num_rows == 0


def test_a_version_1_trace_stays_readable(tmp_path):
    """A trace as verl-ext 0.1 wrote it (schema version 1: step=<n> folders, no rollout_log_prob, no
    end flags, no update tables, no turns): the new columns read as null, nothing else changes."""
    directory = tmp_path / "v1"
    capture = make_capture(1)
    with TraceWriter(TraceOptions(dir=str(directory)), run_record()) as writer:
        writer.submit(capture)
    rewrite_in_the_old_layout(directory, 1)
    assert "rollout_log_prob" not in pq.read_schema(directory / "step=1" / "part-0.parquet").names

    trace = open_trace(str(directory))
    assert trace.record.schema_version == 1 and trace.update_steps == {"actor": [], "critic": []}
    table = trace.read_step(1)
    newer = ["rollout_log_prob", "turn", "role"]
    assert all(table[name].null_count == table.num_rows for name in newer)
    assert table.drop_columns(["step", *newer]).to_pylist() == [
        {k: v for k, v in row.items() if k not in newer} for row in reference_rows(capture)
    ]
    assert trace.prompts(1)["eos"].null_count == trace.prompts(1).num_rows


def test_the_columns_a_version_1_file_lacks_are_the_ones_version_2_added():
    """Each column says the version it appeared in: version 2 added rollout_log_prob and the end flags
    (READABLE_SCHEMA_VERSIONS' note); format 3 changed the layout, no column; format 4 added the turns,
    format 5 the agent loop's roles, tool calls and turn limits, format 6 the per-turn rewards, format 7
    the bootstrap values of cut responses; format 8 the rollout engine's stop reasons (and the run record's
    finish, planned steps and rollout); format 9 no column (the replay's run record); format 10 verl's
    rollout correction: the rejected tokens and the importance weights; format 11 the policy versions of each
    response (and the run record's mode, the steps' global step, sub-step and trainer version)."""
    from verl_ext.trace.schema import added_after

    turns, agents, turn_rewards = {"turn", "assistant_turns"}, {"role", "tool_calls", "turn_limit"}, {"turn_score", "tool_reward"}
    correction = {"rejected", "rollout_is_weight"} | {"policy_version_min", "policy_version_max"}
    later = turn_rewards | {"bootstrap_value", "stop_reason"} | correction
    assert added_after(1) == {"rollout_log_prob", "response_length", "eos", "truncated"} | turns | agents | later
    assert added_after(2) == added_after(3) == turns | agents | later and added_after(4) == agents | later
    assert added_after(5) == later and added_after(6) == {"bootstrap_value", "stop_reason"} | correction
    assert added_after(7) == {"stop_reason"} | correction and added_after(8) == added_after(9) == correction
    assert added_after(10) == {"policy_version_min", "policy_version_max"} and added_after(11) == frozenset()


def test_the_v1_trainer_is_read_back_under_its_own_field_names():
    """The TransferQueue fields of verl's V1 trainer (verl.trainer.ppo.v1), each with the column it fills."""
    from verl_ext.trace.schema import V1_COLUMNS

    assert {column.v1_key: column.name for column in V1_COLUMNS} == {
        "uid": "uid", "prompts": "prompt_token_ids", "responses": "token_id", "response_mask": "mask",
        "rm_scores": "score", "token_level_rewards": "reward", "values": "value", "advantages": "advantage",
        "returns": "return", "old_log_probs": "old_log_prob", "ref_log_prob": "ref_log_prob",
        "rollout_log_probs": "rollout_log_prob", "rollout_is_weights": "rollout_is_weight",
    }  # fmt: skip
