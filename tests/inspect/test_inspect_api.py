"""The notebook path: everything from ``verl_ext.inspect``, no CLI."""

from tests.inspect.inspect_helpers import algorithm, by_definition, random_batch, write_trace
from matplotlib.figure import Figure

import verl_ext.inspect as vi


def test_a_notebook_session(tmp_path):
    path = write_trace(tmp_path / "t", algorithm("mc"), {s: by_definition(random_batch(s), "mc", 1.0) for s in (1, 2)})
    for name in vi.__all__:  # every public name resolves (they are imported on first use)
        getattr(vi, name)

    trace = vi.open_trace(path)
    assert trace.steps == [1, 2]
    report = vi.check_trace(trace)
    assert report.passed and report["returns"].status == "pass"
    assert report.to_arrow().to_pandas().groupby("identity").size().to_dict()["returns"] == 2

    table = vi.sample_view(trace, 2, 1, vi.TokenDecoder()).table.to_pandas()
    assert list(table.columns)[:3] == ["t", "token_id", "token"]
    summary = vi.summarize(path).to_pandas()  # a path works as well as an open trace
    assert summary["step"].tolist() == [1, 2]
    assert trace.to_polars(1).height == trace.read_step(1).num_rows
    assert isinstance(vi.plots.value_vs_return(trace, 1), Figure)
