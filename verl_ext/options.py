"""The options verl-ext reads from a verl config: parsed, defaulted and validated in one place.

Estimator options live in verl's ``algorithm`` node next to ``gamma`` and ``lam``; trace options in
a top-level ``verl_ext.trace`` node; what a non-finite number does in ``verl_ext.nonfinite``. All are
read from an OmegaConf ``DictConfig``, a plain dict or one of verl's typed config dataclasses
(``AlgoConfig``), so this module imports neither verl nor OmegaConf. Every error is a
``ValueError`` that names the config key and the offending value.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

# --------------------------------------------------------------------------- value parsers


def number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {value!r}")
    return float(value)


def unit_interval(key: str, value: Any) -> float:
    parsed = number(key, value)
    if not 0.0 <= parsed <= 1.0:
        raise ValueError(f"{key} must be in [0, 1], got {value!r}")
    return parsed


def positive_float(key: str, value: Any) -> float:
    parsed = number(key, value)
    if not parsed > 0:
        raise ValueError(f"{key} must be > 0, got {value!r}")
    return parsed


def positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
    return value


def boolean(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key} must be true or false, got {value!r}")
    return value


def one_of(*choices: str) -> Callable[[str, Any], str]:
    """A parser that accepts exactly ``choices``."""

    def parse(key: str, value: Any) -> str:
        if value not in choices:
            raise ValueError(f"{key} must be one of {', '.join(choices)}, got {value!r}")
        return value

    return parse


# --------------------------------------------------------------------------- estimator options


@dataclass(frozen=True)
class Option:
    """A key under ``algorithm`` that an estimator reads: its parser, default and meaning.

    ``default`` None means "not set"; the estimator decides what that means (e.g. λ_critic falls
    back to ``lam``). ``required`` options must be set when their estimator is chosen.
    """

    key: str
    parse: Callable[[str, Any], Any]
    default: Any = None
    required: bool = False
    help: str = ""

    def read(self, algorithm: Mapping[str, Any]) -> Any:
        value = algorithm.get(self.key)
        return self.default if value is None else self.parse(f"algorithm.{self.key}", value)


N_STEP = Option("n_step", positive_int, required=True, help="rewards summed before bootstrapping from V(s_{t+n})")
LAM_CRITIC = Option("lam_critic", unit_interval, help="λ of the returns (the critic's target); null: algorithm.lam")
LAM_ACTOR = Option("lam_actor", unit_interval, help="λ of the advantages (the actor's signal); null: algorithm.lam")
LAM_LENGTH_ALPHA = Option(
    "lam_length_alpha", positive_float, help="VAPO length-adaptive λ_actor = 1 − 1/(α·L) per response; null: off"
)
WHITEN_ADVANTAGES = Option(
    "whiten_advantages", boolean, default=True, help="whiten advantages over the batch like verl's masked_whiten"
)
#: Values of ``algorithm.truncation`` (docs/definitions.md #truncated-responses), the default first: what
#: every estimator does at a response cut at data.max_response_length.
TRUNCATION_MODES = ("terminal", "bootstrap", "mask")
TRUNCATION_DEFAULT = TRUNCATION_MODES[0]
TRUNCATION = Option(
    "truncation",
    one_of(*TRUNCATION_MODES),
    default=TRUNCATION_DEFAULT,
    help="a response cut at data.max_response_length: terminal (V after it = 0), bootstrap (from the critic's "
    "value after its last token) or mask (no advantage, out of the whitening)",
)

#: Every option verl-ext's built-in estimators read. Declared in configs/verl_ext_trainer.yaml with
#: these defaults (tests/test_options.py holds it to them); registered estimators may
#: declare more.
ALGORITHM_OPTIONS = (N_STEP, LAM_CRITIC, LAM_ACTOR, LAM_LENGTH_ALPHA, WHITEN_ADVANTAGES, TRUNCATION)
ALGORITHM_KEYS = {option.key: option.default for option in ALGORITHM_OPTIONS}


def algorithm_settings(algorithm: Any) -> dict[str, Any]:
    """The ``algorithm`` node as a plain dict of its top-level keys, whatever its type.

    verl hands over an OmegaConf ``DictConfig``; its signatures advertise a typed ``AlgoConfig``
    (whose ``get`` raises AttributeError for keys it does not declare); tests use dicts.
    """
    if algorithm is None:
        return {}
    if isinstance(algorithm, Mapping) or hasattr(algorithm, "items"):
        return {str(key): value for key, value in algorithm.items()}
    if dataclasses.is_dataclass(algorithm):
        return {field.name: getattr(algorithm, field.name) for field in fields(algorithm)}
    raise ValueError(f"the algorithm config must be a mapping or a config dataclass, got {type(algorithm).__name__}")


# --------------------------------------------------------------------------- the verl_ext node

#: Values of ``verl_ext.nonfinite``: what a non-finite reward, value, return, advantage or log-prob
#: on a valid token does (verl_ext.nonfinite): say so in one line and go on, stop the run with that
#: line before the update, or not look.
NONFINITE_MODES = ("warn", "raise", "off")
NONFINITE_DEFAULT = "warn"
#: ``verl_ext.metrics``: the live metrics (critic and credit, docs/definitions.md §9) in verl's
#: metrics of every step.
METRICS_DEFAULT = True
#: ``verl_ext.turn_rewards``: add the agent loop's per-turn scores (``turn_scores``, ``tool_rewards``) to
#: the rewards of their turns' last tokens before any estimator runs (docs/definitions.md §7).
TURN_REWARDS_DEFAULT = False
#: The keys of the ``verl_ext`` node.
VERL_EXT_KEYS = ("trace", "nonfinite", "metrics", "turn_rewards")


def verl_ext_node(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The root config's ``verl_ext`` node ({} when absent), its keys checked."""
    node = config.get("verl_ext")
    node = {} if node is None else node
    if not isinstance(node, Mapping):
        raise ValueError(f"verl_ext must be a node of options (e.g. verl_ext.trace.dir=/runs/trace), got {node!r}")
    unknown = sorted(set(node) - set(VERL_EXT_KEYS))
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join('verl_ext.' + k for k in unknown)}; verl_ext takes {', '.join(VERL_EXT_KEYS)}")
    return node


def nonfinite_mode(config: Mapping[str, Any]) -> str:
    """``verl_ext.nonfinite`` of the root config: one of :data:`NONFINITE_MODES` (default warn)."""
    value = verl_ext_node(config).get("nonfinite")
    if value is None:
        return NONFINITE_DEFAULT
    if value not in NONFINITE_MODES:
        raise ValueError(f"verl_ext.nonfinite must be one of {', '.join(NONFINITE_MODES)}, got {value!r}")
    return value


def metrics_enabled(config: Mapping[str, Any]) -> bool:
    """``verl_ext.metrics`` of the root config (default :data:`METRICS_DEFAULT`)."""
    value = verl_ext_node(config).get("metrics")
    return METRICS_DEFAULT if value is None else boolean("verl_ext.metrics", value)


def turn_rewards_enabled(config: Mapping[str, Any]) -> bool:
    """``verl_ext.turn_rewards`` of the root config (default :data:`TURN_REWARDS_DEFAULT`)."""
    value = verl_ext_node(config).get("turn_rewards")
    return TURN_REWARDS_DEFAULT if value is None else boolean("verl_ext.turn_rewards", value)


# --------------------------------------------------------------------------- trace options

@dataclass(frozen=True)
class TraceOptions:
    """Where and how often the per-token trace is written; ``dir=None`` means off.

    The fields are the keys of the ``verl_ext.trace`` node and their defaults (:data:`TRACE_KEYS`);
    configs/verl_ext_trainer.yaml declares the same (tests/test_options.py holds it to them).
    """

    dir: str | None = None
    every: int = 1
    max_samples_per_step: int | None = None
    on_error: str = "warn"
    queue_size: int = 2
    update: bool = True  # the update tables (actor and critic, per epoch and mini-batch)

    def __post_init__(self) -> None:
        """Every TraceOptions is valid, however it was made (ValueError naming the key otherwise)."""
        if self.on_error not in ("warn", "raise"):
            raise ValueError(f"verl_ext.trace.on_error must be 'warn' or 'raise', got {self.on_error!r}")
        if self.dir is not None and (not isinstance(self.dir, str) or not self.dir):
            raise ValueError(f"verl_ext.trace.dir must be a non-empty path or URL, got {self.dir!r}")
        positive_int("verl_ext.trace.every", self.every)
        positive_int("verl_ext.trace.queue_size", self.queue_size)
        boolean("verl_ext.trace.update", self.update)
        if self.max_samples_per_step is not None:
            positive_int("verl_ext.trace.max_samples_per_step", self.max_samples_per_step)

    @property
    def enabled(self) -> bool:
        return self.dir is not None

    def traces_step(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "TraceOptions":
        """Read ``verl_ext.trace`` from the root config; an absent node means tracing is off."""
        node = verl_ext_node(config).get("trace")
        node = {} if node is None else node
        if not isinstance(node, Mapping):
            hint = f"; to trace into a directory write verl_ext.trace.dir={node}" if isinstance(node, str) else ""
            raise ValueError(f"verl_ext.trace must be a node of options ({', '.join(TRACE_KEYS)}), got {node!r}{hint}")
        unknown = sorted(f"trace.{k}" for k in set(node) - set(TRACE_KEYS))
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join('verl_ext.' + k for k in unknown)}; "
                f"verl_ext.trace takes {', '.join(TRACE_KEYS)}"
            )
        return cls(**{key: node.get(key, default) for key, default in TRACE_KEYS.items()})

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: Keys of the ``verl_ext.trace`` node, with defaults.
TRACE_KEYS = TraceOptions().as_dict()


# --------------------------------------------------------------------------- environment variables

#: The CPU backend's switch (:mod:`verl_ext.cpu`): any of 1/true/yes, case-insensitive, turns it on.
CPU_SWITCH = "VERL_EXT_CPU"
#: verl's list of modules to import in every process of a run (a user's estimators, plugins).
EXTERNAL_MODULES = "VERL_USE_EXTERNAL_MODULES"
#: The file whose existence asks a run to stop between two steps, named in every process of the run
#: (verl_ext.stopping), and its name in a CPU run's output directory.
STOP_FILE_ENV = "VERL_EXT_STOP_FILE"
STOP_FILE = ".verl-ext.stop"


def cpu_requested() -> bool:
    """True when ``VERL_EXT_CPU`` asks for the CPU backend."""
    return os.environ.get(CPU_SWITCH, "").strip().lower() in ("1", "true", "yes")


def external_modules() -> tuple[str, ...]:
    """The modules ``VERL_USE_EXTERNAL_MODULES`` names (comma-separated), in order."""
    return tuple(filter(None, (module.strip() for module in os.environ.get(EXTERNAL_MODULES, "").split(","))))


def import_external_modules() -> None:
    """Import the modules ``VERL_USE_EXTERNAL_MODULES`` names, as verl does in every process of a run,
    so that a user's estimators are registered where a trace is read too. UsageError when one fails."""
    from verl_ext.errors import UsageError

    for module in external_modules():
        try:
            import_user_module(module)
        except Exception as error:  # noqa: BLE001 - whatever a user's module raises is one line, not a traceback
            raise UsageError(f"cannot import {module} ({EXTERNAL_MODULES}): {user_module_problem(module, error)}") from None


def import_user_module(module: str) -> None:
    """Import a user's module where verl's run finds it: ``python -m verl.trainer.main_ppo`` puts the
    current directory first on ``sys.path``, a console script such as ``verl-ext`` does not. Raises
    whatever the import raises."""
    import importlib
    import sys

    try:
        cwd = os.getcwd()
    except OSError:  # the directory was removed under us: nothing to put on the path
        cwd = None
    if cwd is not None and not any(os.path.abspath(entry or os.curdir) == cwd for entry in sys.path):
        sys.path.insert(0, cwd)
        importlib.invalidate_caches()  # a finder may have listed the directory before the module was written
    importlib.import_module(module)


def user_module_problem(module: str, error: BaseException) -> str:
    """Why importing ``module`` failed, in one line; when the module itself was not found, the fix."""
    text = str(error) if isinstance(error, ImportError) else f"{type(error).__name__}: {error}"
    missing = getattr(error, "name", None)  # ModuleNotFoundError: the module that was not found
    if isinstance(error, ModuleNotFoundError) and missing and (module + ".").startswith(missing + "."):
        top = module.partition(".")[0]
        text += f"; put the directory that holds {top}.py (or the package {top}/) on PYTHONPATH, or run from it"
    return text
