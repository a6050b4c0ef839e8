"""The layout of format 3: every file stores its ``step`` (int64) and each step's files are named
``step-<n>``, which no reader takes for a partition, so the plain call of pandas, polars, DuckDB and
pyarrow (the README's reader lines among them) gives an integer step equal to open_trace's. Traces of formats 1 and 2 (``step=<n>`` folders,
``step`` only in the folder name) are still read, the same, by open_trace and ``verl-ext check``."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import duckdb
import numpy as np
import pandas
import polars
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch
from tests.inspect.inspect_helpers import write_trace as write_batches
from tests.trace.helpers import make_capture, rewrite_in_the_old_layout, run_record
from verl_ext.errors import TraceError
from verl_ext.options import TraceOptions
from verl_ext.trace.update_files import UpdateCapture
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import PROMPT_SCHEMA, SCHEMA_VERSION, TOKEN_SCHEMA, UPDATE_SCHEMAS
from verl_ext.trace.writer import TraceWriter

README = Path(__file__).resolve().parents[2] / "README.md"
STEPS = tuple(range(1, 13))  # 12 steps: as text, 10, 11 and 12 sort between 1 and 2
TOKEN_KEY = ("step", "sample", "token_index")
UPDATE_KEY = ("step", "epoch", "sample", "token_index")


def update_capture(step: int, kind: str) -> UpdateCapture:
    """Two epochs over samples 0 … 2, three tokens each; a float column that differs per step."""
    column = {"actor": "ratio", "critic": "vpred"}[kind]
    parts = [
        {
            "epoch": epoch, "minibatch": 0, "microbatch": 0, "rank": 0, "batch_num_tokens": 9,
            "global_batch_size": 3, "dp_size": 1,
            "columns": {
                "sample": np.repeat(np.arange(3, dtype=np.int32), 3), "token_index": np.tile(np.arange(3, dtype=np.int32), 3),
                column: np.arange(9, dtype=np.float32) + step + epoch / 2,
            },
        }
        for epoch in (0, 1)
    ]  # fmt: skip
    return UpdateCapture(step, kind, parts, {f"{kind}/x": float(step)})


def write_trace(directory, steps=STEPS) -> str:
    with TraceWriter(TraceOptions(dir=str(directory)), run_record()) as writer:
        for step in steps:
            writer.submit(make_capture(step, seed=step))
            writer.submit_update(update_capture(step, "critic"))
            writer.submit_update(update_capture(step, "actor"))
    return str(directory)


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> str:
    return write_trace(tmp_path_factory.mktemp("trace") / "t")


def sorted_rows(rows, key) -> list[dict]:
    def plain(value):  # numpy scalars as Python ones, pandas' NaN for a null as None
        value = value.item() if isinstance(value, np.generic) else value
        return None if isinstance(value, float) and value != value else value

    rows = [{name: plain(value) for name, value in row.items()} for row in rows]
    return sorted(rows, key=lambda row: tuple(row[name] for name in key))


def tokens(directory: str) -> list[dict]:
    """Every token row, as verl-ext's reader gives it."""
    trace = open_trace(directory)
    return sorted_rows(pa.concat_tables(table for _, table in trace.iter_steps()).to_pylist(), TOKEN_KEY)


def update_rows(directory: str, kind: str) -> list[dict]:
    trace = open_trace(directory)
    read = trace.actor_update if kind == "actor" else trace.critic_update
    return sorted_rows(pa.concat_tables(read(step) for step in trace.update_steps[kind]).to_pylist(), UPDATE_KEY)


def prompt_rows(directory: str) -> list[dict]:
    trace = open_trace(directory)
    return sorted_rows(pa.concat_tables(trace.prompts(step) for step in trace.steps).to_pylist(), ("step", "sample"))


def assert_integer_steps(frame: pandas.DataFrame) -> None:
    """What a pandas user does with ``step``: compare it, sort by it."""
    assert str(frame["step"].dtype) == "int64"
    assert sorted(frame["step"].unique().tolist()) == list(STEPS)
    assert set(frame[frame["step"] < 5]["step"]) == {1, 2, 3, 4}
    ordered = frame.sort_values("step", kind="stable")["step"].drop_duplicates().tolist()
    assert ordered == list(STEPS)


# ------------------------------------------------------------------ the plain call of each reader


def test_pandas_read_parquet_of_the_trace_gives_integer_steps(trace_dir):
    frame = pandas.read_parquet(trace_dir)
    assert list(frame.columns) == TOKEN_SCHEMA.names
    assert_integer_steps(frame)
    assert sorted_rows(frame.to_dict("records"), TOKEN_KEY) == tokens(trace_dir)


def test_pandas_reads_the_update_and_prompt_tables_with_integer_steps(trace_dir):
    for kind in ("actor", "critic"):
        frame = pandas.read_parquet(f"{trace_dir}/_{kind}_update")
        assert list(frame.columns) == UPDATE_SCHEMAS[kind].names
        assert_integer_steps(frame)
        assert sorted_rows(frame.to_dict("records"), UPDATE_KEY) == update_rows(trace_dir, kind)
    frame = pandas.read_parquet(f"{trace_dir}/_prompts")
    assert list(frame.columns) == PROMPT_SCHEMA.names and str(frame["step"].dtype) == "int64"
    expected = prompt_rows(trace_dir)
    assert [(r["step"], r["sample"], list(r["prompt_token_ids"])) for r in sorted_rows(frame.to_dict("records"), ("step", "sample"))] == [
        (r["step"], r["sample"], r["prompt_token_ids"]) for r in expected
    ]


def test_polars_reads_the_glob(trace_dir):
    expected = tokens(trace_dir)
    for frame in (
        polars.read_parquet(f"{trace_dir}/step-*/*.parquet"),
        polars.scan_parquet(f"{trace_dir}/step-*/*.parquet").collect(),
    ):
        assert frame.columns == TOKEN_SCHEMA.names and frame.schema["step"] == polars.Int64
        assert frame.filter(polars.col("step") < 5)["step"].unique().sort().to_list() == [1, 2, 3, 4]
        assert sorted_rows(frame.to_dicts(), TOKEN_KEY) == expected
    actor = polars.read_parquet(f"{trace_dir}/_actor_update/step-*/*.parquet")
    assert sorted_rows(actor.to_dicts(), UPDATE_KEY) == update_rows(trace_dir, "actor")


def test_duckdb_reads_the_glob(trace_dir):
    relation = duckdb.sql(f"select * from read_parquet('{trace_dir}/step-*/*.parquet')")
    assert relation.columns == TOKEN_SCHEMA.names and str(relation.types[0]) == "BIGINT"
    rows = [dict(zip(relation.columns, values)) for values in relation.fetchall()]
    assert sorted_rows(rows, TOKEN_KEY) == tokens(trace_dir)
    early = duckdb.sql(f"select distinct step from read_parquet('{trace_dir}/step-*/*.parquet') where step < 5 order by step")
    assert [step for (step,) in early.fetchall()] == [1, 2, 3, 4]
    critic = duckdb.sql(f"select * from read_parquet('{trace_dir}/_critic_update/step-*/*.parquet')")
    rows = [dict(zip(critic.columns, values)) for values in critic.fetchall()]
    assert sorted_rows(rows, UPDATE_KEY) == update_rows(trace_dir, "critic")


def test_pyarrow_reads_the_directory(trace_dir):
    expected = tokens(trace_dir)
    for table in (
        ds.dataset(trace_dir, format="parquet").to_table(),
        ds.dataset(trace_dir, format="parquet", partitioning="hive").to_table(),
        pq.read_table(trace_dir),
        open_trace(trace_dir).dataset().to_table(),
    ):
        assert table.schema.equals(TOKEN_SCHEMA, check_metadata=False)
        assert sorted_rows(table.to_pylist(), TOKEN_KEY) == expected


def readme_readers(path: str) -> dict[str, object]:
    """What each of the README's one-line readers of the token table returns for ``path``, by library."""
    block = re.search(r"<!-- readers -->\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    results = {}
    for line in block.replace("PATH", path).splitlines():
        code = line.split("  #")[0].strip()
        if not code:
            continue
        if code.startswith("import") or re.match(r"\w+ = ", code):
            exec(code, namespace)  # noqa: S102 - the README's own lines
        else:
            results[re.match(r"\w+", code).group(0)] = eval(code, namespace)  # noqa: S307
    return results


def test_every_readme_reader_gives_an_integer_step_that_sorts_numerically(tmp_path):
    """With each library's plain call: no partitioning or hive options to remember."""
    readme = README.read_text()
    block = readme[readme.index("<!-- readers -->") :].split("```")[1]
    assert "partitioning" not in block and "hive" not in block
    batches = {step: by_definition(random_batch(step), "mc", gamma=1.0) for step in (1, 2, 3, 10, 11, 20)}
    readers = readme_readers(write_batches(tmp_path / "t", algorithm("mc"), batches))
    assert set(readers) == {"ds", "pd", "pl", "duckdb"}
    for name, result in readers.items():
        frame = {"ds": lambda r: r.to_table().to_pandas(), "pd": lambda r: r, "pl": lambda r: r.to_pandas(),
                 "duckdb": lambda r: r.df()}[name](result)  # fmt: skip
        assert str(frame["step"].dtype) == "int64", name
        assert sorted(frame["step"].unique().tolist()) == [1, 2, 3, 10, 11, 20], name
        assert frame.sort_values("step", kind="stable")["step"].is_monotonic_increasing, name
        assert set(frame[frame["step"] < 5]["step"]) == {1, 2, 3}, name


def test_every_file_stores_the_step_its_name_says(trace_dir):
    root = Path(trace_dir)
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*.parquet"))
    assert len(files) == 4 * len(STEPS)
    for relative in files:
        step = int(re.fullmatch(r"(?:_prompts/|_actor_update/|_critic_update/)?step-(\d+)(?:/part-0)?\.parquet", relative).group(1))
        table = pq.read_table(root / relative)
        assert table.schema.field("step").type == pa.int64() and set(table["step"].to_pylist()) == {step}, relative
        assert table.schema.metadata[b"verl_ext.schema_version"] == str(SCHEMA_VERSION).encode()
    record = json.loads((root / "_run.json").read_text())
    assert record["schema_version"] == SCHEMA_VERSION == 11
    entry = record["steps"]["11"]
    assert (entry["file"], entry["prompts_file"], entry["updates"]["actor"]["file"]) == (
        "step-11/part-0.parquet", "_prompts/step-11.parquet", "_actor_update/step-11/part-0.parquet"
    )  # fmt: skip


# ------------------------------------------------------------------ traces of formats 1 and 2


@pytest.mark.parametrize("version", [1, 2])
def test_an_old_layout_trace_reads_the_same(trace_dir, tmp_path, version):
    old = tmp_path / "old"
    shutil.copytree(trace_dir, old)
    rewrite_in_the_old_layout(old, version)
    assert (old / "step=10" / "part-0.parquet").is_file() and not list(old.rglob("step-*"))

    new, before = open_trace(trace_dir), open_trace(str(old))
    assert before.record.schema_version == version and before.steps == new.steps == list(STEPS)
    nulled = {"turn", "role"} | ({"rollout_log_prob"} if version == 1 else set())  # the columns newer than the trace
    for step in STEPS:
        table = before.read_step(step)
        assert table.schema.equals(TOKEN_SCHEMA)
        assert table.drop_columns(sorted(nulled)).equals(new.read_step(step).drop_columns(sorted(nulled)))
        assert all(table[name].null_count == table.num_rows for name in nulled)
        assert before.read_step(step, ["step", "kl"]).equals(new.read_step(step, ["step", "kl"]))
        flags = ["assistant_turns", "tool_calls", "turn_limit"] + (["response_length", "eos", "truncated"] if version == 1 else [])
        assert before.prompts(step).drop_columns(flags).equals(new.prompts(step).drop_columns(flags))
        assert before.prompts(step)["assistant_turns"].null_count == len(before.prompts(step))
        old_entry, new_entry = before.step_record(step), new.step_record(step)
        assert (old_entry.file, old_entry.prompts_file) == (f"step={step}/part-0.parquet", f"_prompts/step={step}.parquet")
        assert (old_entry.rows, old_entry.whiten) == (new_entry.rows, new_entry.whiten)
    as_read = [trace.dataset().to_table().drop_columns(sorted(nulled)).to_pylist() for trace in (before, new)]
    assert sorted_rows(as_read[0], TOKEN_KEY) == sorted_rows(as_read[1], TOKEN_KEY)
    if version == 1:
        assert before.update_steps == {"actor": [], "critic": []}
        return
    assert before.update_steps == new.update_steps
    for step in STEPS:
        for kind in ("actor", "critic"):
            read_old, read_new = (before.actor_update, new.actor_update) if kind == "actor" else (before.critic_update, new.critic_update)
            assert read_old(step).equals(read_new(step)) and read_old(step, ["step"]).equals(read_new(step, ["step"]))
            assert before.update_record(kind, step).logged == new.update_record(kind, step).logged
            assert before.update_record(kind, step).file == f"_{kind}_update/step={step}/part-0.parquet"
    # What the old README told a pandas user to type still works there.
    step_key = ds.partitioning(pa.schema([("step", pa.int64())]), flavor="hive")
    as_pandas_reads = pandas.read_parquet(old, partitioning=step_key).to_dict("records")
    assert sorted_rows(as_pandas_reads, TOKEN_KEY) == [{k: v for k, v in row.items() if k not in ("turn", "role")} for row in tokens(trace_dir)]


def test_verl_ext_check_reads_an_old_layout_trace(tmp_path, run_cli):
    from tests.inspect.test_inspect_update import hand_trace

    path = Path(hand_trace(tmp_path / "t"))
    code, out, err = run_cli("check", str(path))
    assert code == 0, out + err
    rewrite_in_the_old_layout(path, 2)
    assert (path / "step=1" / "part-0.parquet").is_file() and (path / "_actor_update" / "step=1").is_dir()
    old_code, old_out, old_err = run_cli("check", str(path))
    # the same report, but a trace before format 4 has no turns to check, nor roles (format 5)
    turns, roles = "turn = the holes before the token", "role = assistant exactly on the policy's tokens"
    assert (old_code, old_err) == (0, err) and all(re.search(rf"{i}.*skipped", old_out) and re.search(rf"{i}.*pass", out) for i in (turns, roles))
    # neither says whether the run finished, nor its rollout engine; the old one says why it cannot
    assert "finished:  unknown (a trace before format 8)" in old_out and "finished:  unknown (the run record does not say)" in out
    same = lambda text: [line for line in text.splitlines() if not re.search(rf"{turns}|{roles}|passed|format [458]|does not say", line)]  # noqa: E731
    assert same(old_out) == same(out) and "(11 passed, 0 failed, 7 skipped)" in old_out
    assert run_cli("summary", str(path))[0] == 0


def test_resuming_a_format_3_trace_goes_on_in_the_newest_format(tmp_path):
    """Format 3 has format 4's folders, without the turns: a run resumed into it writes format 4 there,
    silently, and its old steps read their turns as null."""
    directory = tmp_path / "t"
    write_trace(directory, (1, 2))
    for path in directory.rglob("*.parquet"):  # what format 3 wrote: no turns, version 3 in every footer
        table = pq.read_table(path)
        metadata = {**table.schema.metadata, b"verl_ext.schema_version": b"3"}
        kept = [name for name in table.column_names if name not in ("turn", "assistant_turns")]
        pq.write_table(table.select(kept).replace_schema_metadata(metadata), path)
    record = json.loads((directory / "_run.json").read_text())
    (directory / "_run.json").write_text(json.dumps({**record, "schema_version": 3}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with TraceWriter(TraceOptions(dir=str(directory)), run_record()) as writer:
            writer.submit(make_capture(3, seed=3))
    assert sorted(p.name for p in directory.glob("step*")) == ["step-1", "step-2", "step-3"]
    trace = open_trace(str(directory))
    assert trace.record.schema_version == SCHEMA_VERSION and trace.steps == [1, 2, 3]
    assert trace.read_step(1)["turn"].null_count == trace.read_step(1).num_rows
    assert trace.read_step(3)["turn"].null_count == 0 and trace.prompts(3)["assistant_turns"].null_count == 0


def test_resuming_an_old_layout_trace_keeps_its_layout(tmp_path):
    """One trace, one layout: a writer resuming into a trace of format 2 writes format 2 there, and
    replaces the steps it repeats."""
    directory = tmp_path / "t"
    write_trace(directory, (1, 2, 3))
    rewrite_in_the_old_layout(directory, 2)
    with pytest.warns(UserWarning, match=r"format 2 \(step=<n> folders\): this run's steps go there in that layout"):
        with TraceWriter(TraceOptions(dir=str(directory)), run_record()) as writer:
            writer.submit(make_capture(3, mask=[[1] * 6] * 2, seed=33))
            writer.submit_update(update_capture(3, "actor"))
            writer.submit(make_capture(4, seed=4))
    assert sorted(p.name for p in directory.iterdir()) == [
        "_actor_update", "_critic_update", "_prompts", "_run.json", "step=1", "step=2", "step=3", "step=4"
    ]  # fmt: skip
    assert sorted(p.name for p in (directory / "_prompts").iterdir())[-1] == "step=4.parquet"
    for relative in ("step=4/part-0.parquet", "_prompts/step=4.parquet", "_actor_update/step=3/part-0.parquet"):
        schema = pq.read_schema(directory / relative)
        assert ("step" in schema.names) == relative.startswith("_prompts"), relative
        assert schema.metadata[b"verl_ext.schema_version"] == b"2", relative
    trace = open_trace(str(directory))
    assert trace.record.schema_version == 2 and trace.steps == [1, 2, 3, 4]
    assert trace.read_step(3).num_rows == 12 and trace.prompts(3).num_rows == 2
    assert trace.record.steps["4"].file == "step=4/part-0.parquet"
    assert trace.update_steps["actor"] == [1, 2, 3]
    step_key = ds.partitioning(pa.schema([("step", pa.int64())]), flavor="hive")
    counts = pandas.read_parquet(directory, partitioning=step_key).groupby("step").size().to_dict()
    assert counts == {step: trace.step_record(step).rows for step in (1, 2, 3, 4)}

    with warnings.catch_warnings():  # a new trace (and a fresh directory) gets the new layout, silently
        warnings.simplefilter("error")
        write_trace(tmp_path / "fresh", (1,))
    assert (tmp_path / "fresh" / "step-1" / "part-0.parquet").is_file()


# ------------------------------------------------------------------ folders the writer would not name


def one_line_trace_error(call) -> str:
    with pytest.raises(TraceError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


@pytest.mark.parametrize(
    "version, copy, lives_in",
    [
        (3, "step-03", "step-3"),
        (3, "step=3", "step-3"),  # the old name in a trace of the new layout
        (2, "step=03", "step=3"),
        (2, "step-3", "step=3"),  # the new name in a trace of the old layout
    ],
)
def test_a_step_folder_the_writer_would_not_name_is_refused(tmp_path, version, copy, lives_in):
    directory = tmp_path / "t"
    write_trace(directory, (1, 3))
    if version == 2:
        rewrite_in_the_old_layout(directory, 2)
    shutil.copytree(directory / lives_in, directory / copy)
    assert one_line_trace_error(lambda: open_trace(str(directory))) == (
        f"{directory}/{copy} is not a directory this trace writes: step 3 lives in {lives_in}; remove or rename the copy"
    )
    shutil.rmtree(directory / copy)
    shutil.copytree(directory / lives_in, directory / "_actor_update" / copy)
    assert f"{directory}/_actor_update/{copy} is not a directory this trace writes" in one_line_trace_error(
        lambda: open_trace(str(directory))
    )


def test_a_step_folder_holding_another_step_is_refused(tmp_path):
    directory = tmp_path / "t"
    write_trace(directory, (1, 3))
    (directory / "step-3").rename(directory / "step-4")
    trace = open_trace(str(directory))
    assert trace.steps == [1, 4]
    message = one_line_trace_error(lambda: trace.read_step(4))
    assert message == (
        f"{directory}/step-4/part-0.parquet holds step 3, not 4 (it belongs in step-3/part-0.parquet): "
        "it was moved or copied; move it back or remove it"
    )
    assert trace.read_step(1).num_rows > 0
