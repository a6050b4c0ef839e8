"""The data of the browser view: a trace's run, steps and samples as JSON-ready dicts, one format for
the self-contained page and for the server (the script in ``static/`` reads both). It reads and
encodes only: every statistic, flag and re-estimate comes from :mod:`verl_ext.inspect` and
:mod:`verl_ext.check`; what it adds is how the page shows them (colour scales, prompt keys).

* :func:`page_schema`: what the page's script knows of the data, sent with it (the clip codes and
  their colours, the index of an unknown code, the token table's float columns, the update columns
  and how to show each, the summary's fields, the quantities a token can be coloured by), all
  derived from their records (:mod:`verl_ext.trace.schema`, :data:`verl_ext.inspect.summary.SUMMARY_SCHEMA`):
  a new column or field reaches the page by its record alone;
* :func:`run_info`: what the page says about the run (estimator, rollout engine, steps, tokenizer, and
  notes: a run that did not finish, the steps missing or that do not read).
* :class:`StepSource`: one step read once (token table, prompts, update tables), and from it
  - :meth:`~StepSource.overview`: every sample of the step with its flags (wrong answer, truncated,
    clipped by PPO, non-finite), its assistant turns, tool calls and rejected tokens, the PPO epochs,
    and the colour scale of each quantity over the step; in a trace of verl's asynchronous trainers also the
    step's place in verl's loop, each sample's policy versions and staleness, and the step's versions and
    staleness levels (docs/definitions.md#policy-versions);
  - :meth:`~StepSource.chunk`: the tokens of some samples: decoded pieces, every column of the token
    table (a token's role as its index in ``role_names``, NO_CODE when unknown; ``rejected``, by verl's
    rollout correction, as 0/1 where the run records it, else null), the estimators' raw
    advantages re-estimated (``td0``'s is δ_t), and per PPO epoch the update rows of each token; in an
    asynchronous run's trace, ``policy_version`` and ``staleness`` among the columns: each token of the
    policy's the value of its response (null elsewhere, and where unknown);
  - :meth:`~StepSource.statistics`: the step's ``summary`` row, whitening μ/σ, the estimators
    compared (what ``verl-ext compare`` computes) and the ``check`` failures located in the step.

Numbers travel exactly: arrays are the trace's own float32 (int32, uint8) values, little-endian,
base64-encoded (``{"t": "f4" | "i4" | "u1", "b": "..."}``); a Parquet null is marked in a separate
0/1 array (``nulls``), so null and NaN stay distinct.
"""

from __future__ import annotations

import base64
import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from verl_ext.errors import UsageError
from verl_ext.inspect import summary as summary_module
from verl_ext.inspect.summary import sample_flags, whitening
from verl_ext.steps.cuts import BOOTSTRAP_COLUMN, StepCuts
from verl_ext.steps.layout import StepData, StepLayout, floats, join_keys, locate
from verl_ext.steps.recorded import RecordedAlgorithm
from verl_ext.steps.update_rows import UpdateRows
from verl_ext.steps.versions import StepPlace, StepVersions, describe_mode, may_be_asynchronous
from verl_ext.trace import schema
from verl_ext.trace.reader import listing

#: The value a quantity's colour scale is centred on (0 for every other one).
CENTRES = {"ratio": 1.0, "rollout_is_weight": 1.0}
#: The quantities defined on every token the policy wrote, the ones verl's rollout correction rejected
#: included (docs/definitions.md#off-policy-tokens): a rejected token is coloured by these (its other
#: numbers are those of a token nothing trained on), and their colour scales are over those tokens.
OWN_TOKENS = ("log_ratio", "rollout_is_weight")
#: A code column (``clip``, ``role``) as small integers: the index in its codes (CLIP_CODES,
#: ROLE_CODES), NO_CODE when null or unknown (:func:`code_indices`).
NO_CODE = 255
#: The colour of a token in each clip region (an unclipped token's is white, with dark text).
CLIP_COLOURS = {schema.CLIP_NONE: "#ffffff", schema.CLIP_LOW: "#4575b4", schema.CLIP_HIGH: "#d73027", schema.CLIP_DUAL: "#7b3294"}
#: Update-table columns the page does not show per token: where a row was trained beyond its
#: mini-batch (the join keys and the token table's own columns are left out as well).
UPDATE_NOT_SHOWN = ("epoch", "microbatch", "rank")
#: How each encoding travels: little-endian float32, int32, uint8.
_DTYPES = {"f4": np.dtype("<f4"), "i4": np.dtype("<i4"), "u1": np.dtype("u1")}


@dataclass(frozen=True)
class _Kind:
    """How the page shows an update column (its ``name``), how it travels, how its values are read
    from the table, and what a token the epoch did not train gets."""

    name: str
    encoding: str
    read: Callable[[pa.ChunkedArray], np.ndarray]
    untrained: float


#: The kind of an update column, by its Arrow type.
_KINDS = (
    (pa.types.is_string, _Kind("code", "u1", lambda data: code_indices(data, schema.CLIP_CODES), NO_CODE)),
    (pa.types.is_boolean, _Kind("flag", "u1", lambda data: data.fill_null(False).to_numpy(zero_copy_only=False).astype(np.uint8), 0)),
    (pa.types.is_integer, _Kind("int", "i4", lambda data: data.to_numpy().astype(np.int32), 0)),
    (pa.types.is_floating, _Kind("float", "f4", lambda data: floats(data, np.float32), np.nan)),
)
#: The summary's fields the step line leaves out (the whitening μ, σ stand for the raw advantage's
#: mean and std; the rest are in ``verl-ext summary``); every other field of SUMMARY_SCHEMA is shown.
SUMMARY_NOT_SHOWN = ("step", "reward", "value", "return", "adv_raw_mean", "adv_raw_std", "adv_mean", "adv_std")
#: Labels and decimals of the summary's fields where not their name and 4.
SUMMARY_LABELS = {"explained_var": "explained var", "ev_mc": "EV vs MC return", "ev_mc_last": "EV at last token",
                  "adv_dlogp_corr": "corr(A, Δlog π)", "clip_low": "clip low", "clip_high": "clip high", "clip_dual": "clip dual",
                  "truncated_share": "cut share", "adv_truncated": "mean A of cut", "adv_rest": "mean A of the rest",
                  "lp_gap_p50": "|ℓ| p50", "lp_gap_p99": "|ℓ| p99", "lp_gap_max": "|ℓ| max", "offpolicy_kl": "KL(rollout‖old)",
                  "is_mean": "mean IS weight", "is_ess": "IS ESS", "is_truncated": "IS weights truncated/zeroed",
                  "rejected_tokens": "rejected token share", "rejected_responses": "responses with a rejection"}  # fmt: skip
SUMMARY_DIGITS = {"samples": 0, "tokens": 0, "score": 3, "explained_var": 3, "ev_mc": 3, "ev_mc_last": 3, "adv_dlogp_corr": 3, "truncated_share": 3,
                  "is_mean": 3, "is_ess": 3, "is_truncated": 3, "rejected_tokens": 3, "rejected_responses": 3}  # fmt: skip
#: Headers of the comparison's columns (verl_ext.inspect.comparison's statistics) where not their name.
COMPARISON_LABELS = {"var_batch": "Var over the step", "var_within_group": "Var within a prompt's group", "mean_abs": "mean |A|"}
#: What a token can be coloured by, in the page's order: (key, kind, label[, what it reads: by
#: default the column of that name]). kind: column (token table), delta (td0's re-estimate), update
#: (the chosen PPO epoch's row), difference (of two token columns: the first minus the second); the
#: re-estimated raw advantages follow, one per estimator. Centred at CENTRES, over OWN_TOKENS.
QUANTITIES = (
    ("advantage", "column", "advantage (whitened, as trained)"),
    ("advantage_raw", "column", "advantage, raw (before whitening)"),
    ("value", "column", "value V(s_t)"),
    ("return", "column", "return (critic target)"),
    ("reward", "column", "reward r_t"),
    ("score", "column", "score s_t"),
    ("tool_reward", "column", "tool reward (on the calling turn's last token)"),
    ("turn_score", "column", "turn score (on the turn's last token)"),
    ("kl", "column", "KL kld_t"),
    ("delta", "delta", "δ_t = r_t + γV_{t+1} − V_t", "td0"),
    ("entropy", "update", "entropy (epoch)"),
    ("ratio", "update", "ratio π_θ/π_old (epoch)"),
    ("clip", "update", "clip region (epoch)"),
    ("pg_loss", "update", "policy-loss term (epoch)"),
    ("vf_loss", "update", "value-loss term (epoch)"),
    ("log_ratio", "difference", "log-ratio ℓ = log π_old − log π_rollout", ("old_log_prob", "rollout_log_prob")),
    ("rollout_is_weight", "column", "importance weight w_t (verl's rollout_is_weight)"),
    ("policy_version", "column", "policy version (of the weights that generated the response)"),
    ("staleness", "column", "staleness (trainer version − policy version)"),
)  # fmt: skip
#: The quantities of a response, not of a token (docs/definitions.md#policy-versions): each token the policy
#: wrote has its response's; coloured by level, not on a scale: a colour per version ("palette"), white to red
#: by staleness ("sequential"). Sent as columns of the chunk, only in a trace of an asynchronous run.
RESPONSE_LEVELS = {"policy_version": "palette", "staleness": "sequential"}
#: The summary's staleness fields the step line shows (verl_ext.inspect.summary.STALENESS_SCHEMA; the step's
#: place, its global step, sub-step and trainer version, is said beside the step's number).
STALENESS_LABELS = {"staleness_mean": "mean staleness", "staleness_max": "largest staleness", "stale_share": "stale share",
                    "spanned_share": "spanned share"}  # fmt: skip


# --------------------------------------------------------------------------- what the page knows


def update_columns() -> dict[str, tuple[schema.Column, ...]]:
    """kind -> the update table's columns the page shows per PPO epoch: those the token table does
    not have, but UPDATE_NOT_SHOWN (so the mini-batch, and every term of the update)."""
    token_names = {column.name for column in schema.TOKEN_COLUMNS}
    return {
        kind: tuple(c for c in columns if c.name not in token_names and c.name not in UPDATE_NOT_SHOWN)
        for kind, columns in schema.UPDATE_COLUMNS.items()
    }


def _kind(column: schema.Column) -> _Kind:
    for test, kind in _KINDS:
        if test(column.type):
            return kind
    raise TypeError(f"update column {column.name}: the view cannot show type {column.type}")


def code_indices(column: pa.ChunkedArray | pa.Array, codes: Sequence[str]) -> np.ndarray:
    """A string column as uint8 indices into ``codes``, NO_CODE where null or not one of them."""
    return pc.index_in(column, value_set=pa.array(codes)).fill_null(NO_CODE).to_numpy(zero_copy_only=False).astype(np.uint8)


def page_schema() -> dict:
    """What the page's script knows of the data's fields (module docstring)."""
    shown: dict[str, str] = {}
    for columns in update_columns().values():
        for column in columns:
            shown.setdefault(column.name, _kind(column).name)
    quantities = []
    for key, kind, label, *reads in QUANTITIES:
        name = reads[0] if reads else key
        quantity = {"key": key, "label": label, "kind": kind, "name": list(name) if isinstance(name, tuple) else name}
        if quantity["key"] in CENTRES:
            quantity["centre"] = CENTRES[quantity["key"]]
        if quantity["key"] in OWN_TOKENS or quantity["key"] in RESPONSE_LEVELS:
            quantity["own"] = True
        if quantity["key"] in RESPONSE_LEVELS:
            quantity["levels"] = RESPONSE_LEVELS[quantity["key"]]
        if quantity["kind"] == "update" and shown.get(quantity["name"]) == "code":
            quantity["categorical"] = True
        quantities.append(quantity)
    fields = [name for name in summary_module.SUMMARY_SCHEMA.names if name not in SUMMARY_NOT_SHOWN]
    return {
        "clip_codes": list(schema.CLIP_CODES),
        "clip_colours": {code: CLIP_COLOURS[code] for code in schema.CLIP_CODES},
        "clip_none": schema.CLIP_NONE,
        "no_code": NO_CODE,
        "float_columns": [column.name for column in schema.FLOAT_COLUMNS],
        "update_columns": [{"name": name, "kind": kind} for name, kind in shown.items()],
        "summary_fields": [{"key": name, "label": SUMMARY_LABELS.get(name, name), "digits": SUMMARY_DIGITS.get(name, 4)} for name in fields],
        "staleness_fields": [{"key": name, "label": label, "digits": 3} for name, label in STALENESS_LABELS.items()],
        "quantities": quantities,
    }


# --------------------------------------------------------------------------- encoding


def encode(values: np.ndarray, kind: str) -> dict[str, str]:
    """An array as ``{"t": kind, "b": base64}``; kind "f4" (float32), "i4" (int32) or "u1" (uint8)."""
    return {"t": kind, "b": base64.b64encode(np.ascontiguousarray(values, dtype=_DTYPES[kind]).tobytes()).decode("ascii")}


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


def own_scales(data: StepData) -> dict[str, float | None]:
    """The colour scale of each quantity of OWN_TOKENS the step has: its largest |x − centre| over the
    policy's own tokens, valid or rejected (``data``'s table holds the columns it reads)."""
    scales = {}
    for key, kind, _, *reads in QUANTITIES:
        if key not in OWN_TOKENS:
            continue
        names = reads[0] if reads else (key,)
        values = [data.at_own_tokens(name) if name in data.table.column_names else None for name in names]
        if any(v is None for v in values):
            continue
        at = values[0] - values[1] if kind == "difference" else values[0]
        scales[key] = _largest(at, CENTRES.get(key, 0.0))
    return scales


def _largest(values: np.ndarray, centre: float = 0.0, finite: np.ndarray | None = None) -> float | None:
    """max |x − centre| over the finite values (or those where ``finite``); None without any."""
    finite = np.isfinite(values) if finite is None else finite
    if not finite.any():
        return None
    return float(np.max(np.abs(values - centre if centre else values), where=finite, initial=0.0))


# --------------------------------------------------------------------------- the run


def run_info(trace, decoder, unread=None) -> dict:
    """What the page says about the run; ``unread``: the steps left out (:class:`UnreadSteps`; by
    default those the run record lists and the disk lacks), said in ``notes`` with whether the run
    finished."""
    from verl_ext.steps.recorded import RecordedRun
    from verl_ext.inspect.unread import UnreadSteps

    record = trace.record
    algorithm = RecordedAlgorithm.from_record(record)
    run = RecordedRun.of(trace)
    unread = UnreadSteps.of(trace) if unread is None else unread
    unfinished = f"the run did not finish: {run.steps_done()}" if run.finished is False else None
    mode = describe_mode(record.mode)  # an asynchronous trainer's: said in the run's line
    return clean({
        **({"mode": mode} if mode else {}),
        "path": str(trace.path),
        "estimator": algorithm.describe(),
        "rollout": run.describe_rollout(),
        "finished": run.finished,
        "planned_steps": run.planned_steps,
        "notes": [*([unfinished] if unfinished else []), *unread.lines()],
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
        reads = {"tokens": lambda: trace.read_step(step, [name for name in schema.TOKEN_SCHEMA.names if name not in ("uid", "step")])}
        reads["prompts"] = lambda: trace.prompts(step)
        kinds = [kind for kind in update_columns() if step in trace.update_steps.get(kind, [])]
        for kind in kinds:
            reads[kind] = lambda kind=kind: _ShownUpdate(trace, kind, step)
        with ThreadPoolExecutor(len(reads)) as pool:
            futures = {name: pool.submit(read) for name, read in reads.items()}
            done = {name: future.result() for name, future in futures.items()}
        self.table = done["tokens"]
        self.layout = StepLayout.of(self.table)
        self.index = {int(sample): i for i, sample in enumerate(self.layout.sample_ids)}
        self.present = [name for name in schema.FLOAT_COLUMN_NAMES if self.table.column(name).null_count < self.table.num_rows]
        prompts = done["prompts"]
        self._prompts = prompts
        self._prompt_row = {int(s): i for i, s in enumerate(prompts.column("sample").to_pylist())}
        self._uid = prompts.column("uid").to_pylist()
        self._prompt_ids = prompts.column("prompt_token_ids").to_pylist()
        self._prompt_flags = {name: prompts.column(name).to_pylist() for name in ("eos", "truncated", "assistant_turns", "tool_calls")}
        # V(s_L) of a cut response, where the run bootstrapped it (docs/definitions.md#truncated-responses)
        self._prompt_flags[BOOTSTRAP_COLUMN] = (
            prompts.column(BOOTSTRAP_COLUMN).to_pylist() if BOOTSTRAP_COLUMN in prompts.column_names else [None] * prompts.num_rows
        )
        entry = trace.step_record(step)
        self.whiten = entry.whiten
        versions = StepVersions.of(StepPlace.of(trace, step, entry), prompts) if may_be_asynchronous(trace.record) else None
        #: the step's place in an asynchronous run (its dict), and its responses' policy versions where it records
        #: them; None for a synchronous run's step (and None for the versions of a step that records none)
        self.place = None if versions is None else versions.place.as_dict()
        self.versions = versions if versions is not None and versions.known else None
        self.updates = {kind: done[kind] for kind in kinds}  # in UPDATE_COLUMNS' order: the actor's first
        self.epochs = sorted({epoch for shown in self.updates.values() for epoch in shown.rows.epochs()})
        self._estimates: tuple[dict[str, np.ndarray], list[str]] | None = None

    # ------------------------------------------------------------------ samples

    def require_sample(self, sample: int) -> int:
        if sample not in self.index:
            raise UsageError(f"step {self.step} has no sample {sample} (traced samples: {listing(sorted(self.index))})")
        return sample

    def overview(self) -> dict:
        """Every sample of the step with its flags; the PPO epochs; the colour scale of each quantity
        (its largest |x − centre| over the step's valid tokens, or over the trained rows of an epoch)."""
        layout = self.layout
        data = StepData.from_table(self.step, self.table, self.present, layout)
        flagged = sample_flags(data, [shown.rows for shown in self.updates.values()])
        score = flagged["score"]
        scales: dict[str, float | None] = {name: _largest(values) for name, values in data.columns.items()}
        scales |= own_scales(data)
        for shown in self.updates.values():
            epochs = {epoch: shown.rows.epoch == epoch for epoch in self.epochs}
            for name, values in shown.floats.items():
                finite = np.isfinite(values)
                for epoch, in_epoch in epochs.items():
                    scales[f"e{epoch}:{name}"] = _largest(values, CENTRES.get(name, 0.0), finite & in_epoch)
        keys = _prompt_keys(self._prompt_ids)
        flags = self._prompt_flags
        rejected = None if layout.rejected is None else np.bincount(layout.row_sample, weights=layout.rejected, minlength=layout.samples)
        sample_versions = None if self.versions is None else self._sample_versions(layout.sample_ids)
        entries = []
        for i, sample in enumerate(layout.sample_ids.tolist()):
            row = self._prompt_row.get(sample)
            entries.append({
                "sample": sample,
                "uid": self.uid(sample),
                "rows": int(layout.row_counts[i]),
                "valid": int(layout.valid_counts[i]),
                "score": None if score is None else float(score[i]),
                "wrong": bool(flagged["wrong"][i]),
                "truncated": bool(row is not None and flags["truncated"][row]),
                "bootstrap_value": None if row is None else flags[BOOTSTRAP_COLUMN][row],
                "eos": None if row is None else flags["eos"][row],
                "turns": None if row is None else flags["assistant_turns"][row],
                "tool_calls": None if row is None else flags["tool_calls"][row],
                "rejected": None if rejected is None else int(rejected[i]),
                "clipped": bool(flagged["clipped"][i]),
                "nonfinite": bool(flagged["nonfinite"][i]),
                "prompt": None if row is None else keys[row],
                **({} if sample_versions is None else {name: values[i] for name, values in sample_versions.items()}),
            })  # fmt: skip
        return clean({
            **({} if self.place is None else {"place": self.place}),
            **({} if self.versions is None else {"levels": self._levels(sample_versions)}),
            "step": self.step,
            "rows": self.table.num_rows,
            "valid": len(layout.valid_rows),
            "samples": entries,
            "epochs": self.epochs,
            "columns": self.present,
            "update_columns": list(dict.fromkeys(name for rows in self.updates.values() for name in rows.columns)),
            "scales": scales,
            "whiten": whitening(self.whiten),
        })  # fmt: skip

    def _sample_versions(self, sample_ids: np.ndarray) -> dict[str, list]:
        """Per sample: version_min, version_max, staleness (None where unknown), as the overview sends them."""
        at = self.versions.at(sample_ids)
        return {name: [None if not np.isfinite(v) else int(v) for v in values] for name, values in at.items()}

    def _levels(self, sample_versions: dict[str, list]) -> dict[str, list[int]]:
        """The step's policy versions and staleness levels (the legends of the tokens coloured by them)."""
        return {
            "policy_version": sorted({v for v in sample_versions["version_min"] if v is not None}),
            "staleness": sorted({v for v in sample_versions["staleness"] if v is not None}),
        }

    def _version_columns(self, part: pa.Table) -> dict[str, np.ndarray]:
        """policy_version (and policy_version_max where a response spans a weight update), staleness: at each
        row of ``part`` the value of its response on the policy's own tokens (valid or rejected), NaN elsewhere
        and where unknown."""
        at = self.versions.at(part.column("sample").to_numpy())
        own = part.column("mask").to_numpy(zero_copy_only=False).copy()
        rejected = part.column("rejected")
        if rejected.null_count < len(rejected):
            own |= rejected.fill_null(False).to_numpy(zero_copy_only=False)
        columns = {"policy_version": at["version_min"], "staleness": at["staleness"]}
        if np.any(at["version_max"] > at["version_min"]):
            columns["policy_version_max"] = at["version_max"]
        return {name: np.where(own, values, np.nan) for name, values in columns.items()}

    # ------------------------------------------------------------------ tokens

    def chunk(self, samples: Iterable[int] | None = None) -> dict:
        """The tokens of ``samples`` (default: every sample of the step), row by row."""
        samples = list(self.layout.sample_ids.tolist() if samples is None else samples)
        indices = [self.index[self.require_sample(sample)] for sample in samples]
        rows = self.layout.rows_of(indices)
        part = self.table.take(pa.array(rows, pa.int64()))
        starts = np.concatenate(([0], np.cumsum(self.layout.row_counts[indices]))).astype(int).tolist()
        token_ids = part.column("token_id")
        ids = token_ids.fill_null(-1).to_numpy(zero_copy_only=False)
        pieces: list[str] = []
        for begin, end in zip(starts[:-1], starts[1:]):
            sample_ids = ids[begin:end].tolist()
            pieces += self.decoder.pieces(sample_ids) if -1 not in sample_ids else ["?"] * (end - begin)
        mask = part.column("mask").to_numpy(zero_copy_only=False)
        rejected = part.column("rejected")  # null in a run without verl's rollout correction: not sent
        columns, nulls = {}, {}
        for name in self.present:
            column = part.column(name)
            columns[name] = encode(floats(column, np.float32), "f4")
            if column.null_count:
                nulls[name] = encode(column.is_null().to_numpy(zero_copy_only=False), "u1")
        if token_ids.null_count:
            nulls["token_id"] = encode(token_ids.is_null().to_numpy(zero_copy_only=False), "u1")
        if self.versions is not None:  # a response's versions on each of its tokens (the policy's own)
            for name, values in self._version_columns(part).items():
                columns[name] = encode(np.nan_to_num(values, nan=0.0), "f4")
                nulls[name] = encode(np.isnan(values), "u1")
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
            "rejected": None if rejected.null_count == len(rejected) else encode(rejected.fill_null(False).to_numpy(zero_copy_only=False), "u1"),
            "turn": encode(part.column("turn").fill_null(0).to_numpy(zero_copy_only=False), "i4"),
            "role": encode(code_indices(part.column("role"), schema.ROLE_CODES), "u1"),
            "role_names": list(schema.ROLE_CODES),
            "columns": columns,
            "nulls": nulls,
            "estimates": estimates,
            "epochs": [self._epoch_rows(epoch, samples, part) for epoch in self.epochs],
        })  # fmt: skip

    def uid(self, sample: int) -> str | None:
        """verl's prompt id of ``sample`` (from the prompt table: one per sample)."""
        row = self._prompt_row.get(sample)
        return None if row is None else self._uid[row]

    def _prompt_text(self, sample: int) -> str | None:
        row = self._prompt_row.get(sample)
        ids = None if row is None else self._prompt_ids[row]
        if ids is None:
            return None
        text = self.decoder.text(ids)
        return text if text is not None else " ".join(f"#{i}" for i in ids)

    def _epoch_rows(self, epoch: int, samples: list[int], part: pa.Table) -> dict:
        """The update rows of ``epoch`` at the chunk's rows: ``trained`` (0/1) and each column (a
        column of two tables, the mini-batch, is the first table's: the actor's)."""
        keys = join_keys(part.column("sample").to_numpy(), part.column("token_index").to_numpy())
        trained = np.zeros(part.num_rows, np.uint8)
        columns = {}
        for shown in self.updates.values():
            picked = shown.rows.of(samples, epoch)
            at, found = locate(keys, join_keys(shown.rows.sample[picked], shown.rows.token_index[picked]))
            target = at[found]
            trained[target] = 1
            for name in shown.columns:
                if name in columns:
                    continue
                kind = shown.kinds[name]
                out = np.full(part.num_rows, kind.untrained, _DTYPES[kind.encoding])
                out[target] = shown.values(name)[picked][found]
                columns[name] = encode(out, kind.encoding)
        return {"epoch": epoch, "trained": encode(trained, "u1"), "columns": columns}

    # ------------------------------------------------------------------ estimators and statistics

    def estimates(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """label -> raw advantage re-estimated at the step's valid tokens (verl_ext.inspect.comparison);
        empty, with a note, without rewards or values."""
        if self._estimates is None:
            self._estimates = self._estimate(self.table, self.layout)
        return self._estimates

    def _estimate(self, table: pa.Table, layout: StepLayout | None = None) -> tuple[dict[str, np.ndarray], list[str]]:
        from verl_ext.steps.as_run import step_estimates

        if "reward" not in self.present or "value" not in self.present:
            return {}, ["no rewards or values to re-estimate from (a run without a critic?)"]
        data = StepData.from_table(self.step, table, ("reward", "value"), layout)
        return step_estimates(data, self.algorithm, cuts=StepCuts.of(self._prompts, data.layout))

    def _chunk_estimates(self, rows: np.ndarray, part: pa.Table) -> dict[str, np.ndarray]:
        """The raw advantages at the chunk's rows (NaN at masked rows): from the step's, once they
        are computed; else re-estimated on the chunk alone (each response is estimated on its own)."""
        if self._estimates is not None or len(rows) == self.table.num_rows:
            raw, _ = self.estimates()
            position = self.layout.valid_position[rows]
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
        """The step's ``summary`` row, the whitening μ, σ (the step record's; else the summary's raw
        advantage mean and std), the estimators compared over the step, the colour scales of the
        re-estimated advantages, and the failures of ``report`` (a CheckReport) in this step."""
        from verl_ext.inspect.comparison import step_estimator_statistics

        raw, notes = self.estimates()
        comparison = columns = None
        if raw:
            table, more = step_estimator_statistics(raw, self.layout, self._prompts)
            notes = notes + more
            comparison = table.to_pylist()
            columns = [{"key": name, "label": COMPARISON_LABELS.get(name, name)} for name in table.column_names if name != "estimator"]
        return clean({
            "step": self.step,
            "summary": summary_row,
            "whiten": whitening(self.whiten, summary_row),
            "comparison": comparison,
            "comparison_columns": columns,
            "comparison_notes": notes,
            "scales": {f"est:{label}": _largest(values) for label, values in raw.items()},
            "check": None if report is None else check_failures(report, self.step),
            "not_checked": None if report is None else check_not_checked(report),
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


def check_not_checked(report) -> list[dict]:
    """Why identities of a CheckReport that apply to the run were not evaluated (the check is
    incomplete, never passed then): each reason with the identities it kept from being checked."""
    titles = {result.identity: result.title for result in report.identities}
    return [
        {"reason": reason, "identities": [{"identity": name, "title": titles.get(name, name)} for name in names]}
        for reason, names in report.not_checked.items()
    ]


class _ShownUpdate:
    """One update table of a step as the page shows it: its rows (:class:`UpdateRows`: where each
    trained, its flags) and the columns the page shows per token, each as it travels (code columns
    as their index in CLIP_CODES, flags as 0/1, floats as float32)."""

    def __init__(self, trace, kind: str, step: int):
        shown = update_columns()[kind]
        self.rows = UpdateRows.read(trace, kind, step, [c.name for c in shown])
        table = self.rows.table
        self.kinds: dict[str, _Kind] = {}
        self._values: dict[str, np.ndarray] = {}
        #: the float columns (their colour scales)
        self.floats: dict[str, np.ndarray] = {}
        for column in shown:
            data = table.column(column.name)
            if data.null_count >= max(table.num_rows, 1):
                continue
            kind = self.kinds[column.name] = _kind(column)
            values = self._values[column.name] = kind.read(data)
            if kind.name == "float":
                self.floats[column.name] = values
        self.columns = list(self._values)

    def values(self, name: str) -> np.ndarray:
        return self._values[name]


def _prompt_keys(prompts: list[list[int] | None]) -> list[str | None]:
    """One short hash per prompt (equal prompts, equal keys): how the page finds a prompt across steps."""
    return [None if ids is None else prompt_key(ids) for ids in prompts]


def prompt_key(ids: Sequence[int]) -> str:
    return hashlib.blake2b(np.asarray(ids, "<i4").tobytes(), digest_size=6).hexdigest()
