"""The data of the browser view: a trace's run, steps and samples as JSON-ready dicts, one format for
the self-contained page and for the server (the script in ``static/viewer.js`` reads both).

* :func:`run_info`: what the page says about the run (estimator, steps, tokenizer).
* :class:`StepSource`: one step read once (token table, prompts, update tables), and from it
  - :meth:`~StepSource.overview`: every sample of the step with its flags (wrong answer, truncated,
    clipped by PPO, non-finite), the PPO epochs, and the colour scale of each quantity over the step;
  - :meth:`~StepSource.chunk`: the tokens of some samples: decoded pieces, every column of the token
    table, the estimators' raw advantages re-estimated (``td0``'s is δ_t), and per PPO epoch the
    update rows of each token;
  - :meth:`~StepSource.statistics`: the step's ``summary`` row, whitening μ/σ, the estimators
    compared (what ``verl-ext compare`` computes) and the ``check`` failures located in the step.

Numbers travel exactly: arrays are the trace's own float32 (int32, uint8) values, little-endian,
base64-encoded (``{"t": "f4" | "i4" | "u1", "b": "..."}``); a Parquet null is marked in a separate
0/1 array (``nulls``), so null and NaN stay distinct. The math is :mod:`verl_ext.inspect`'s.
"""

from __future__ import annotations

import base64
import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from verl_ext.errors import UsageError
from verl_ext.inspect.stepdata import RecordedAlgorithm, StepData, StepLayout
from verl_ext.trace.reader import listing
from verl_ext.trace.schema import CLIP_CODES, FLOAT_COLUMN_NAMES, TOKEN_SCHEMA

#: Update-table columns the page shows per PPO epoch (the others repeat the token table's).
ACTOR_COLUMNS = ("minibatch", "log_prob", "ratio", "pg_loss", "clip", "entropy", "is_weight")
CRITIC_COLUMNS = ("vpred", "vpred_clipped", "vf_loss", "vf_clipped")
#: The value a quantity's colour scale is centred on (0 for every other one).
CENTRES = {"ratio": 1.0}
#: ``clip`` as a small integer: the index in CLIP_CODES, NO_CODE when null or unknown.
NO_CODE = 255


# --------------------------------------------------------------------------- encoding


def encode(values: np.ndarray, kind: str) -> dict[str, str]:
    """An array as ``{"t": kind, "b": base64}``; kind "f4" (float32), "i4" (int32) or "u1" (uint8)."""
    dtype = {"f4": "<f4", "i4": "<i4", "u1": "u1"}[kind]
    return {"t": kind, "b": base64.b64encode(np.ascontiguousarray(values, dtype=dtype).tobytes()).decode("ascii")}


def clean(value: Any) -> Any:
    """``value`` as strict JSON data: NaN and ±inf become null, numpy scalars Python numbers."""
    if isinstance(value, dict):
        return {str(key): clean(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _floats(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """float64 values, NaN where null."""
    if column.null_count:
        column = column.fill_null(float("nan"))
    return np.asarray(column.to_numpy(zero_copy_only=False), np.float64)


def _float32(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """float32 values, NaN where null."""
    if column.null_count:
        column = column.fill_null(float("nan"))
    return np.asarray(column.to_numpy(zero_copy_only=False), np.float32)


def _largest(values: np.ndarray, centre: float = 0.0, finite: np.ndarray | None = None) -> float | None:
    """max |x − centre| over the finite values (or those where ``finite``); None without any."""
    finite = np.isfinite(values) if finite is None else finite
    if not finite.any():
        return None
    return float(np.max(np.abs(values - centre if centre else values), where=finite, initial=0.0))


# --------------------------------------------------------------------------- the run


def run_info(trace, decoder) -> dict:
    """What the page says about the run."""
    record = trace.record
    algorithm = RecordedAlgorithm.from_record(record)
    return clean({
        "path": str(trace.path),
        "estimator": algorithm.describe(),
        "gamma": algorithm.gamma,
        "verl_version": record.verl_version,
        "trainer": record.trainer,
        "created_at": record.created_at,
        "steps": list(trace.steps),
        "update_steps": {kind: list(steps) for kind, steps in trace.update_steps.items()},
        "tokenizer": decoder.source,
        "tokenizer_problem": decoder.problem,
    })  # fmt: skip


# --------------------------------------------------------------------------- one step


class StepSource:
    """One step of a trace, read once: the token table (all columns), the prompt table and the
    update tables. ``decoder``: a :class:`verl_ext.inspect.table.TokenDecoder`."""

    def __init__(self, trace, step: int, decoder):
        trace.require_step(step)
        self.trace = trace
        self.step = step
        self.decoder = decoder
        self.algorithm = RecordedAlgorithm.from_record(trace.record)
        # The step's files are read at the same time (pyarrow decodes without holding the GIL). The
        # token table without uid (a string per token, the slowest column): the prompt table has it.
        reads = {"tokens": lambda: trace.read_step(step, [name for name in TOKEN_SCHEMA.names if name not in ("uid", "step")])}
        reads["prompts"] = lambda: trace.prompts(step)
        for kind, names in (("actor", ACTOR_COLUMNS), ("critic", CRITIC_COLUMNS)):
            if step in trace.update_steps.get(kind, []):
                columns = ["sample", "token_index", "epoch", *names]
                reads[kind] = (lambda kind=kind, columns=columns, names=names: _UpdateRows(
                    trace.actor_update(step, columns) if kind == "actor" else trace.critic_update(step, columns), names))
        with ThreadPoolExecutor(len(reads)) as pool:
            futures = {name: pool.submit(read) for name, read in reads.items()}
            done = {name: future.result() for name, future in futures.items()}
        self.table = done["tokens"]
        self.layout = StepLayout(
            self.table.column("sample").to_numpy(),
            self.table.column("token_index").to_numpy(),
            self.table.column("mask").to_numpy(zero_copy_only=False),
        )
        self.index = {int(sample): i for i, sample in enumerate(self.layout.sample_ids)}
        self.present = [name for name in FLOAT_COLUMN_NAMES if self.table.column(name).null_count < self.table.num_rows]
        prompts = done["prompts"]
        self._prompt_row = {int(s): i for i, s in enumerate(prompts.column("sample").to_pylist())}
        self._uid = prompts.column("uid").to_pylist()
        self._prompt_ids = prompts.column("prompt_token_ids").to_pylist()
        self._prompt_flags = {name: prompts.column(name).to_pylist() for name in ("eos", "truncated")}
        self.whiten = trace.step_record(step).whiten
        self.updates = {kind: done[kind] for kind in ("actor", "critic") if kind in done}
        self.epochs = sorted({int(e) for rows in self.updates.values() for e in np.unique(rows.epoch)})
        self._estimates: tuple[dict[str, np.ndarray], list[str]] | None = None
        self._valid_position: np.ndarray | None = None  # row -> index among the valid tokens, or −1

    # ------------------------------------------------------------------ samples

    def require_sample(self, sample: int) -> int:
        if sample not in self.index:
            raise UsageError(f"step {self.step} has no sample {sample} (traced samples: {listing(sorted(self.index))})")
        return sample

    def _rows(self, samples: Sequence[int]) -> np.ndarray:
        """Row indices of the token table for ``samples``, in that order."""
        layout = self.layout
        pieces = [np.arange(layout.starts[i], layout.starts[i] + layout.row_counts[i]) for i in (self.index[s] for s in samples)]
        return np.concatenate(pieces) if pieces else np.zeros(0, np.int64)

    def overview(self) -> dict:
        """Every sample of the step with its flags; the PPO epochs; the colour scale of each quantity
        (its largest |x − centre| over the step's valid tokens, or over the trained rows of an epoch)."""
        layout = self.layout
        valid = layout.valid_rows
        per_sample = layout.row_sample[valid]
        samples = layout.samples
        score = None
        if "score" in self.present:
            score = np.bincount(per_sample, weights=_floats(self.table.column("score"))[valid], minlength=samples)
        finite_scores = score[np.isfinite(score)] if score is not None else np.zeros(0)
        best = finite_scores.max() if len(finite_scores) else None
        bad = np.zeros(len(valid), bool)  # a valid token with a value missing or not finite
        scales: dict[str, float | None] = {}
        for name in self.present:
            column = self.table.column(name)
            values = _float32(column)[valid]  # the trace's float32: its largest |x| is exact
            finite = np.isfinite(values)
            bad |= ~finite
            scales[name] = _largest(values, finite=finite)
        nonfinite = np.zeros(samples, bool)
        nonfinite[np.unique(per_sample[bad])] = True
        clipped = np.zeros(samples, bool)
        for rows in self.updates.values():
            where = self._sample_index(rows.sample)
            known = where >= 0
            epochs = {epoch: rows.epoch == epoch for epoch in self.epochs}
            for name, values in rows.floats.items():
                finite = np.isfinite(values)
                nonfinite[np.unique(where[~finite & known])] = True
                for epoch, in_epoch in epochs.items():
                    scales[f"e{epoch}:{name}"] = _largest(values, CENTRES.get(name, 0.0), finite & in_epoch)
            if rows.clip is not None:
                hit = (rows.clip != CLIP_CODES.index("none")) & (rows.clip != NO_CODE) & known
                clipped[np.unique(where[hit])] = True
        keys = _prompt_keys(self._prompt_ids)
        flags = self._prompt_flags
        uid = [self.uid(sample) for sample in layout.sample_ids.tolist()]
        entries = []
        for i, sample in enumerate(layout.sample_ids.tolist()):
            row = self._prompt_row.get(sample)
            entries.append({
                "sample": sample,
                "uid": uid[i],
                "rows": int(layout.row_counts[i]),
                "valid": int(layout.valid_counts[i]),
                "score": None if score is None else float(score[i]),
                "wrong": bool(best is not None and np.isfinite(score[i]) and score[i] < best),
                "truncated": bool(row is not None and flags["truncated"][row]),
                "eos": None if row is None else flags["eos"][row],
                "clipped": bool(clipped[i]),
                "nonfinite": bool(nonfinite[i]),
                "prompt": None if row is None else keys[row],
            })  # fmt: skip
        return clean({
            "step": self.step,
            "rows": self.table.num_rows,
            "valid": len(valid),
            "samples": entries,
            "epochs": self.epochs,
            "columns": self.present,
            "update_columns": sorted({name for rows in self.updates.values() for name in rows.columns}),
            "scales": scales,
            "whiten": _whitening(self.whiten),
        })  # fmt: skip

    # ------------------------------------------------------------------ tokens

    def chunk(self, samples: Iterable[int] | None = None) -> dict:
        """The tokens of ``samples`` (default: every sample of the step), row by row."""
        samples = list(self.layout.sample_ids.tolist() if samples is None else samples)
        for sample in samples:
            self.require_sample(sample)
        rows = self._rows(samples)
        part = self.table.take(pa.array(rows, pa.int64()))
        counts = [int(self.layout.row_counts[self.index[s]]) for s in samples]
        starts = np.concatenate(([0], np.cumsum(counts))).astype(int).tolist()
        token_ids = part.column("token_id")
        ids = token_ids.fill_null(-1).to_numpy(zero_copy_only=False)
        pieces: list[str] = []
        for begin, end in zip(starts[:-1], starts[1:]):
            sample_ids = ids[begin:end].tolist()
            pieces += self.decoder.pieces(sample_ids) if -1 not in sample_ids else ["?"] * (end - begin)
        mask = part.column("mask").to_numpy(zero_copy_only=False)
        columns, nulls = {}, {}
        for name in self.present:
            column = part.column(name)
            columns[name] = encode(_floats(column), "f4")
            if column.null_count:
                nulls[name] = encode(column.is_null().to_numpy(zero_copy_only=False), "u1")
        if token_ids.null_count:
            nulls["token_id"] = encode(token_ids.is_null().to_numpy(zero_copy_only=False), "u1")
        estimates = {label: encode(values, "f4") for label, values in self._chunk_estimates(rows, part).items()}
        return clean({
            "step": self.step,
            "samples": samples,
            "starts": starts,
            "pieces": pieces,
            "prompts": [self._prompt_text(s) for s in samples],
            "prompts_decoded": self.decoder.available,
            "token_index": encode(part.column("token_index").to_numpy(), "i4"),
            "token_id": encode(ids, "i4"),
            "mask": encode(mask, "u1"),
            "columns": columns,
            "nulls": nulls,
            "estimates": estimates,
            "epochs": [self._epoch_rows(epoch, samples, part) for epoch in self.epochs],
        })  # fmt: skip

    def uid(self, sample: int) -> str | None:
        """verl's prompt id of ``sample`` (from the prompt table: one per sample)."""
        row = self._prompt_row.get(sample)
        return None if row is None else self._uid[row]

    def _sample_index(self, samples: np.ndarray) -> np.ndarray:
        """Index (0 … B−1) of each of ``samples`` in the step, −1 for a sample the step lacks."""
        ids = self.layout.sample_ids.astype(np.int64)
        lookup = np.full(int(max(ids.max(initial=-1), samples.max(initial=-1))) + 2, -1, np.int64)
        lookup[ids] = np.arange(len(ids))
        return lookup[np.clip(samples.astype(np.int64), -1, len(lookup) - 1)]

    def _prompt_text(self, sample: int) -> str | None:
        row = self._prompt_row.get(sample)
        ids = None if row is None else self._prompt_ids[row]
        if ids is None:
            return None
        text = self.decoder.text(ids)
        return text if text is not None else " ".join(f"#{i}" for i in ids)

    def _epoch_rows(self, epoch: int, samples: list[int], part: pa.Table) -> dict:
        """The update rows of ``epoch`` at the chunk's rows: ``trained`` (0/1) and each column."""
        keys = part.column("sample").to_numpy().astype(np.int64) << 32 | part.column("token_index").to_numpy().astype(np.int64)
        order = np.argsort(keys, kind="stable")
        trained = np.zeros(part.num_rows, np.uint8)
        columns = {}
        for rows in self.updates.values():
            picked = rows.of(samples, epoch)
            wanted = rows.sample[picked].astype(np.int64) << 32 | rows.token_index[picked].astype(np.int64)
            at = np.minimum(np.searchsorted(keys[order], wanted), max(len(keys) - 1, 0))
            found = keys[order][at] == wanted if len(keys) else np.zeros(len(wanted), bool)
            target = order[at[found]]
            trained[target] = 1
            for name in rows.columns:
                source = rows.values(name)[picked][found]
                kind = "i4" if name == "minibatch" else "u1" if name in ("clip", "vf_clipped") else "f4"
                fill = NO_CODE if name == "clip" else 0 if kind != "f4" else np.nan
                out = np.full(part.num_rows, fill, {"i4": np.int32, "u1": np.uint8, "f4": np.float64}[kind])
                out[target] = source
                columns[name] = encode(out, kind)
        return {"epoch": epoch, "trained": encode(trained, "u1"), "columns": columns}

    # ------------------------------------------------------------------ estimators and statistics

    def estimates(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """label -> raw advantage re-estimated at the step's valid tokens (verl_ext.inspect.comparison);
        empty, with a note, without rewards or values."""
        if self._estimates is None:
            self._estimates = self._estimate(self.table)
        return self._estimates

    def _estimate(self, table: pa.Table) -> tuple[dict[str, np.ndarray], list[str]]:
        from verl_ext.inspect.comparison import step_estimates

        if "reward" not in self.present or "value" not in self.present:
            return {}, ["no rewards or values to re-estimate from (a run without a critic?)"]
        data = StepData.from_table(self.step, table, ("reward", "value"))
        return step_estimates(data, self.algorithm)

    def _chunk_estimates(self, rows: np.ndarray, part: pa.Table) -> dict[str, np.ndarray]:
        """The raw advantages at the chunk's rows (NaN at masked rows): from the step's, once they
        are computed; else re-estimated on the chunk alone (each response is estimated on its own)."""
        if self._estimates is not None or len(rows) == self.table.num_rows:
            raw, _ = self.estimates()
            if self._valid_position is None:
                self._valid_position = np.full(self.table.num_rows, -1, np.int64)
                self._valid_position[self.layout.valid_rows] = np.arange(len(self.layout.valid_rows))
            position = self._valid_position[rows]
            valid = position >= 0
            return {label: np.where(valid, values[np.where(valid, position, 0)], np.nan) if len(values) else np.full(len(rows), np.nan) for label, values in raw.items()}
        raw, _ = self._estimate(part)
        valid = np.flatnonzero(part.column("mask").to_numpy(zero_copy_only=False))
        out = {}
        for label, values in raw.items():
            full = np.full(part.num_rows, np.nan)
            full[valid] = values
            out[label] = full
        return out

    def statistics(self, summary_row: dict | None, report=None) -> dict:
        """The step's ``summary`` row, the estimators compared over the step, the colour scales of
        the re-estimated advantages, and the failures of ``report`` (a CheckReport) in this step."""
        from verl_ext.inspect.comparison import estimator_statistics

        raw, notes = self.estimates()
        layout = self.layout
        comparison = None
        if raw:
            sample_ids = layout.sample_ids[layout.valid_sample_index()]
            per_sample = [self.uid(sample) for sample in layout.sample_ids.tolist()]
            if any(u is None for u in per_sample):
                uid = np.full(len(layout.valid_rows), None, dtype=object)  # no uid: each response alone
            else:
                codes = {u: i for i, u in enumerate(dict.fromkeys(per_sample))}
                uid = np.array([codes[u] for u in per_sample], np.int64)[layout.valid_sample_index()]
            table, more = estimator_statistics(raw, uid, sample_ids)
            notes = notes + more
            comparison = table.to_pylist()
        return clean({
            "step": self.step,
            "summary": summary_row,
            "comparison": comparison,
            "comparison_notes": notes,
            "scales": {f"est:{label}": _largest(values) for label, values in raw.items()},
            "check": None if report is None else check_failures(report, self.step),
        })  # fmt: skip


def check_failures(report, step: int | None = None) -> list[dict]:
    """The failed (identity, step) results of a CheckReport (of ``step`` only, if given), each with
    its first offending (step, sample, token)."""
    titles = {result.identity: result.title for result in report.identities}
    failures = []
    for result in report.per_step:
        if result.status != "fail" or (step is not None and result.step != step):
            continue
        first = result.first
        location = first.location if first is not None else None
        failures.append({
            "identity": result.identity,
            "title": titles.get(result.identity, result.identity),
            "step": result.step,
            "sample": None if location is None else location.sample,
            "token": None if location is None else location.token_index,
            "violations": result.violations,
            "text": str(first) if first is not None else (result.note or "failed"),
        })  # fmt: skip
    return failures


class _UpdateRows:
    """One update table of a step as numpy arrays, findable by (sample, epoch)."""

    def __init__(self, table: pa.Table, names: Sequence[str]):
        self.sample = table.column("sample").to_numpy()
        self.token_index = table.column("token_index").to_numpy()
        self.epoch = table.column("epoch").to_numpy()
        self.columns = [name for name in names if table.column(name).null_count < max(table.num_rows, 1)]
        self._values: dict[str, np.ndarray] = {}
        for name in self.columns:
            column = table.column(name)
            if name == "clip":
                codes = pc.index_in(column, value_set=pa.array(CLIP_CODES)).fill_null(NO_CODE)
                self._values[name] = codes.to_numpy(zero_copy_only=False).astype(np.uint8)
            elif name == "vf_clipped":
                self._values[name] = column.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint8)
            elif name == "minibatch":
                self._values[name] = column.to_numpy().astype(np.int32)
            else:
                self._values[name] = _float32(column)
        self.clip = self._values.get("clip")
        #: the float columns (non-finite values are flagged)
        self.floats = {name: values for name, values in self._values.items() if values.dtype == np.float32}
        # rows by (epoch, sample): the writer's order already, so sorting is only a fallback
        key = self.epoch.astype(np.int64) << 32 | self.sample.astype(np.int64)
        self._order = None if bool(np.all(key[1:] >= key[:-1])) else np.argsort(key, kind="stable")
        self._key = key if self._order is None else key[self._order]

    def values(self, name: str) -> np.ndarray:
        return self._values[name]

    def of(self, samples: Sequence[int], epoch: int) -> np.ndarray:
        """Row indices of ``samples`` in ``epoch``."""
        picked = []
        for sample in samples:
            wanted = np.int64(epoch) << 32 | np.int64(sample)
            lo, hi = np.searchsorted(self._key, [wanted, wanted + 1])
            picked.append(np.arange(lo, hi) if self._order is None else self._order[lo:hi])
        return np.concatenate(picked) if picked else np.zeros(0, np.int64)


def _prompt_keys(prompts: list[list[int] | None]) -> list[str | None]:
    """One short hash per prompt (equal prompts, equal keys): how the page finds a prompt across steps."""
    return [None if ids is None else prompt_key(ids) for ids in prompts]


def prompt_key(ids: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(ids, "<i4").tobytes(), digest_size=6).hexdigest()


def _whitening(stats: dict | None) -> dict | None:
    """{"mean": μ, "sigma": σ} from the step record's whitening statistics {"mean", "var"}."""
    if not stats or stats.get("mean") is None or stats.get("var") is None or stats["var"] < 0:
        return None
    return {"mean": stats["mean"], "sigma": math.sqrt(stats["var"])}
