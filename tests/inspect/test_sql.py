"""SQL over a trace (verl_ext.inspect.sql, ``verl-ext sql``): the views hold every step and row of the
trace's tables, join on (step, sample, token_index), decode the tokens with the run's tokenizer, and
answer as the Parquet files do; the command prints text, CSV and JSON, and a bad query is one line.

Covers: verl_ext.inspect.sql, the CLI's sql, Trace.local_root."""

from __future__ import annotations

import csv
import io
import json
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from tests.inspect.inspect_helpers import rewrite_step
from tests.trace.helpers import rewrite_in_the_old_layout
from tests.view.view_helpers import SHOWN, VOCAB, save_piece_tokenizer, write_view_trace
from verl_ext.inspect.sql import VIEWS, connect
from verl_ext.trace.reader import open_trace
from verl_ext.trace.schema import TOKEN_SCHEMA


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("sql")
    return write_view_trace(directory / "trace", save_piece_tokenizer(directory / "tok"), steps=(1, 2, 3))


def test_every_view_holds_every_step_and_row_of_its_files(trace):
    opened = open_trace(trace)
    con = connect(trace)
    assert {name for (name,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()} >= set(VIEWS)
    for step in opened.steps:
        rows = pq.read_table(f"{trace}/step-{step}/part-0.parquet").num_rows
        assert con.execute("SELECT count(*) FROM tokens WHERE step = ?", [step]).fetchone()[0] == rows
        prompts = pq.read_table(f"{trace}/_prompts/step-{step}.parquet").num_rows
        assert con.execute("SELECT count(*) FROM prompts WHERE step = ?", [step]).fetchone()[0] == prompts
        for kind in ("actor", "critic"):
            updates = pq.read_table(f"{trace}/_{kind}_update/step-{step}/part-0.parquet").num_rows
            assert con.execute(f"SELECT count(*) FROM {kind}_updates WHERE step = ?", [step]).fetchone()[0] == updates > 0
    steps = con.execute("SELECT step, rows, samples, kl_coef, whiten_mean FROM steps ORDER BY step").fetchall()
    assert [row[:3] for row in steps] == [(s, opened.record.steps[str(s)].rows, opened.record.steps[str(s)].samples) for s in opened.steps]
    assert [row[4] for row in steps] == [opened.record.steps[str(s)].whiten["mean"] for s in opened.steps]


def test_the_tables_join_on_step_sample_and_token_index(trace):
    con = connect(trace)
    updates = con.execute("SELECT count(*) FROM actor_updates").fetchone()[0]
    joined = con.execute("SELECT count(*) FROM actor_updates a JOIN tokens t USING (step, sample, token_index)").fetchone()[0]
    assert joined == updates
    # the update rows carry the token table's advantage (docs/definitions.md §8, item 6)
    differs = con.execute("SELECT count(*) FROM actor_updates a JOIN tokens t USING (step, sample, token_index) WHERE a.advantage <> t.advantage").fetchone()[0]
    assert differs == 0


def test_a_query_answers_as_the_parquet_files_do(trace):
    """The mean advantage over valid tokens per step, by SQL and by numpy over the files."""
    con = connect(trace)
    by_sql = dict(con.execute("SELECT step, avg(advantage) FROM tokens WHERE mask GROUP BY step").fetchall())
    for step in (1, 2, 3):
        table = pq.read_table(f"{trace}/step-{step}/part-0.parquet", columns=["mask", "advantage"]).to_pandas()
        assert by_sql[step] == pytest.approx(float(np.mean(table["advantage"][table["mask"]].astype(np.float64))), rel=1e-12)


def test_tokens_are_decoded_by_the_runs_tokenizer(trace):
    rows = connect(trace).execute("SELECT token_id, token FROM tokens WHERE token_id IS NOT NULL").fetchall()
    assert rows and all(token == SHOWN[VOCAB[token_id]] for token_id, token in rows)


def test_the_command_prints_text_csv_and_json(trace, run_cli):
    query = "SELECT step, count(*) AS samples FROM prompts GROUP BY step ORDER BY step"
    code, out, _ = run_cli("sql", trace, query, "--format", "csv")
    samples = [pq.read_table(f"{trace}/_prompts/step-{s}.parquet").num_rows for s in (1, 2, 3)]
    assert code == 0 and list(csv.reader(io.StringIO(out))) == [["step", "samples"], *[[str(s), str(n)] for s, n in zip((1, 2, 3), samples)]]
    code, out, _ = run_cli("sql", trace, query, "--format", "json")
    assert code == 0 and json.loads(out) == [{"step": s, "samples": n} for s, n in zip((1, 2, 3), samples)]
    code, out, _ = run_cli("sql", trace, query)
    assert code == 0 and out.splitlines()[0].split() == ["step", "samples"] and len(out.splitlines()) >= 4


@pytest.mark.parametrize(
    "query, said",
    [
        ("SELECT nonsense FROM tokens", 'Binder Error: Referenced column "nonsense" not found'),
        ("SELEC 1", "Parser Error: syntax error at or near"),
        ("SELECT * FROM no_such_table", "Catalog Error: Table with name no_such_table does not exist"),
    ],
)
def test_a_bad_query_is_one_line(trace, run_cli, query, said):
    code, out, err = run_cli("sql", trace, query)
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"verl-ext sql: {said}"), err


# --------------------------------------------------------------------------- read-only (issue 59, item 1)


def snapshot(directory) -> dict[str, bytes]:
    """Every file under ``directory`` and its bytes."""
    return {str(path): path.read_bytes() for path in sorted(Path(directory).rglob("*")) if path.is_file()}


#: Statements an inspection must refuse, whatever the spelling: writing a file (a trace's own file
#: first), reading one other than through the views (outside the trace or inside it), loading code,
#: and undoing the settings that forbid these. ``{trace}``: the trace; ``{outside}``: a folder beside it.
REFUSED = [
    "COPY (SELECT 1 AS x) TO '{trace}/step-1/part-0.parquet' (FORMAT parquet)",
    "COPY (SELECT 1 AS x) TO '{trace}/step-1/part-0.parquet' (FORMAT csv, USE_TMP_FILE false)",
    "COPY tokens TO '{outside}/tokens.csv'",
    "SELECT 1; COPY (SELECT 1) TO '{outside}/second.csv'",
    "EXPORT DATABASE '{outside}/export'",
    "ATTACH '{outside}/db.duckdb' AS other",
    "CREATE PERSISTENT SECRET leaked (TYPE s3, KEY_ID 'a', SECRET 'b')",
    "INSTALL httpfs",
    "LOAD '{outside}/code.duckdb_extension'",
    "SELECT * FROM read_csv('{outside}/secret.csv')",
    "SELECT * FROM read_text('{outside}/secret.csv')",
    "SELECT * FROM read_blob('{outside}/secret.csv')",
    "SELECT * FROM glob('{outside}/*')",
    "SELECT * FROM '{outside}/secret.csv'",
    "SELECT * FROM read_json('{trace}/_run.json')",
    "SELECT count(*) FROM parquet_scan('{trace}/step-1/part-0.parquet')",
    "SELECT * FROM read_parquet('https://example.invalid/x.parquet')",
    "SET enable_external_access = true",
    "RESET lock_configuration",
    "SET allowed_directories = ['/']",
    "SET log_query_path = '{outside}/queries.log'",
    "PRAGMA enable_profiling = 'json'",
]


@pytest.fixture
def outside(tmp_path):
    """A folder that is not the trace's, with a file no query may read."""
    (tmp_path / "secret.csv").write_text("password\nhunter2\n")
    return tmp_path


@pytest.mark.parametrize("statement", REFUSED)
def test_the_command_refuses_any_statement_that_reads_or_writes_a_file_or_a_setting(trace, outside, run_cli, statement):
    before = snapshot(trace), snapshot(outside)
    code, out, err = run_cli("sql", trace, statement.format(trace=trace, outside=outside))
    assert code == 2 and out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    # DuckDB's own words for a file it may not touch and a setting it may not change
    assert "Permission Error" in err or "the configuration has been locked" in err, err
    assert (snapshot(trace), snapshot(outside)) == before


@pytest.mark.parametrize(
    "statement",
    ["CREATE TABLE mine AS SELECT step, count(*) AS n FROM tokens GROUP BY step", "ATTACH ':memory:' AS scratch", "SET threads = 1"],
)
def test_what_stays_in_memory_is_allowed(trace, outside, run_cli, statement):
    before = snapshot(trace)
    code, _, err = run_cli("sql", trace, statement)
    assert (code, err) == (0, "") and snapshot(trace) == before


def test_connect_is_read_only_unless_asked_otherwise(trace, outside):
    import duckdb

    con = connect(trace)
    with pytest.raises(duckdb.PermissionException):
        con.execute(f"COPY (SELECT 1) TO '{outside}/x.csv'")
    with pytest.raises(duckdb.Error, match="locked"):
        con.execute("SET enable_external_access = true")
    with pytest.raises(duckdb.PermissionException):  # a cursor shares the locked database
        con.cursor().execute(f"SELECT * FROM read_csv('{outside}/secret.csv')")
    assert con.execute("SELECT count(*) FROM tokens WHERE step = 1").fetchone()[0] == pq.read_metadata(f"{trace}/step-1/part-0.parquet").num_rows

    unrestricted = connect(trace, unrestricted=True)
    unrestricted.execute(f"COPY (SELECT step, count(*) AS n FROM tokens GROUP BY step ORDER BY step) TO '{outside}/x.csv'")
    assert (outside / "x.csv").read_text().splitlines()[0] == "step,n"


# --------------------------------------------------------------------------- Ctrl-C (issue 59, item 2)

#: A five-way cross join of the token rows: hours of work, for a query that must stop at once.
ENDLESS = "SELECT sum(a.advantage * b.advantage * c.advantage * d.advantage * e.advantage) FROM tokens a, tokens b, tokens c, tokens d, tokens e"


def test_ctrl_c_stops_a_query_at_once_with_one_line_and_exit_130(trace):
    """`verl-ext sql` in its own process, SIGINT once the query runs: it stops within seconds (DuckDB
    itself took no notice of it for minutes), says so in one line and exits 130."""
    code = (
        "import sys, transformers, verl_ext.cli.sql\nfrom verl_ext.cli import main\n"
        "print('ready', file=sys.stderr, flush=True)\nsys.exit(main(sys.argv[1:]))"
    )
    process = subprocess.Popen([sys.executable, "-c", code, "sql", trace, ENDLESS], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stderr.readline() == "ready\n"  # imported: what is left before the query takes moments
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=20)  # a generous bound: 0.2-0.5 s here, most of it the interpreter's exit
    finally:
        if process.poll() is None:
            process.kill()
    assert (process.returncode, out, err) == (130, "", "verl-ext sql: interrupted\n")


# --------------------------------------------------------------------------- a file that does not read (issue 59, item 3)


def test_a_token_file_whose_data_does_not_read_is_one_line_pointing_at_check(tmp_path, run_cli):
    """Its footer reads (so the step is not left out up front) but a column's pages do not: a query
    that reads them says which kind of file, in one line, exit 2; one that does not need them answers."""
    path = write_view_trace(tmp_path / "trace", save_piece_tokenizer(tmp_path / "tok"), steps=(1, 2), updates=False)
    file = Path(path) / "step-2" / "part-0.parquet"
    chunk = pq.read_metadata(file).row_group(0).column(TOKEN_SCHEMA.get_field_index("value"))
    data = bytearray(file.read_bytes())
    data[chunk.data_page_offset : chunk.data_page_offset + chunk.total_compressed_size] = b"\xab" * chunk.total_compressed_size
    file.write_bytes(bytes(data))
    code, out, err = run_cli("sql", path, "SELECT step, avg(value) FROM tokens GROUP BY step")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"verl-ext sql: a token file of {path} does not read (") and err.endswith(f"; verl-ext check {path} names it\n")
    code, out, err = run_cli("sql", path, "SELECT count(*) AS n FROM tokens WHERE step = 1", "--format", "csv")
    assert (code, out, err) == (0, f"n\n{pq.read_metadata(Path(path) / 'step-1' / 'part-0.parquet').num_rows}\n", "")


@pytest.mark.parametrize("version", [1, 2])
def test_a_trace_of_the_old_layout_answers_as_its_files_do(trace, tmp_path, version):
    """Formats 1 and 2 keep ``step`` in the folder name only and lack the newer columns (null here)."""
    old = tmp_path / "old"
    shutil.copytree(trace, old)
    rewrite_in_the_old_layout(old, version)
    con = connect(str(old))
    counts = dict(con.execute("SELECT step, count(*) FROM tokens GROUP BY step").fetchall())
    assert counts == {step: pq.read_metadata(old / f"step={step}" / "part-0.parquet").num_rows for step in (1, 2, 3)}
    assert con.execute("SELECT count(*) FROM tokens WHERE turn IS NOT NULL OR role IS NOT NULL").fetchone()[0] == 0
    assert con.execute("SELECT typeof(step) FROM tokens LIMIT 1").fetchone()[0] == "BIGINT"


# --------------------------------------------------------------------------- the docs' recipes


def docs_recipe(mark: str) -> list[str]:
    """The arguments of the ``verl-ext sql`` line of docs/inspecting.md that holds ``mark``."""
    text = (Path(__file__).parents[2] / "docs" / "inspecting.md").read_text(encoding="utf-8")
    (line,) = [line for line in text.splitlines() if line.startswith("verl-ext sql ") and mark in line]
    return shlex.split(line)[1:]


def test_the_largest_gap_recipe_shows_the_gaps_of_an_fp32_run(tmp_path, run_cli):
    """An fp32 run's rollout and trainer log-probs differ by 1e-7 or less: the docs' query shows each
    response's largest gap in digits that say it (4 decimals said 0.0000 on every row)."""
    path = write_view_trace(tmp_path / "trace", save_piece_tokenizer(tmp_path / "tok"), steps=(1,), updates=False)
    def fp32_gaps(t):  # a gap of 3e-6 × (sample + 1) at every third token, half that elsewhere: the largest differ by sample
        sample, index = t["sample"].to_numpy(), t["token_index"].to_numpy()
        delta = (3e-6 * (sample + 1) * np.where(index % 3 == 0, 1.0, 0.5)).astype(np.float32)
        return t.set_column(t.schema.get_field_index("rollout_log_prob"), "rollout_log_prob", pc.add(t["old_log_prob"], pa.array(delta)))

    rewrite_step(path, 1, table=fp32_gaps)
    table = pq.read_table(f"{path}/step-1/part-0.parquet").to_pandas()
    valid = table[table["mask"]]
    gaps = (valid["rollout_log_prob"].astype(np.float64) - valid["old_log_prob"].astype(np.float64)).abs().groupby(valid["sample"]).max()
    expected = gaps.sort_values(ascending=False).head(5)
    assert 0 < expected.min() and expected.max() < 5e-5  # 0.0000 at 4 decimals
    argv = docs_recipe("largest_gap")
    code, out, err = run_cli(*[path if arg == "PATH" else arg for arg in argv])
    assert (code, err) == (0, "")
    header, *rows = [line.split() for line in out.splitlines()]
    shown = {int(row[header.index("sample")]): float(row[header.index("largest_gap")]) for row in rows}
    assert list(shown) == list(expected.index)
    assert all(shown[sample] == pytest.approx(gap, rel=1e-2) for sample, gap in expected.items()), (shown, expected.to_dict())
