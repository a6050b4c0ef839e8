"""SQL over a trace (verl_ext.inspect.sql, ``verl-ext sql``): the views hold every step and row of the
trace's tables, join on (step, sample, token_index), decode the tokens with the run's tokenizer, and
answer as the Parquet files do; the command prints text, CSV and JSON, and a bad query is one line.

Covers: verl_ext.inspect.sql, the CLI's sql, Trace.local_root."""

from __future__ import annotations

import csv
import io
import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.view.view_helpers import SHOWN, VOCAB, save_piece_tokenizer, write_view_trace
from verl_ext.inspect.sql import VIEWS, connect
from verl_ext.trace.reader import open_trace


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
