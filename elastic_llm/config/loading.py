"""Loading a run configuration: YAML and ``--set key=value`` overrides in, a validated :class:`RunConfig` out.

Owns: reading the YAML file, applying the overrides (dotted keys, YAML values), putting the named ``recovery.policy``'s settings in, turning the
mapping into the typed sections (unknown keys and wrong types refused naming the field), and
validating the result (:mod:`.rules`). Never starts Ray or touches the filesystem beyond the file.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
import os
from pathlib import Path
from typing import Any

import yaml

from elastic_llm.config.rules import validate
from elastic_llm.config.schema import ConfigError, RunConfig
from elastic_llm.policies import DP, Policy, named

log = logging.getLogger("elastic_llm.config")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Check ``value`` against the annotated type ``tp``; int is accepted for float."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if isinstance(value, str) and str in inner:
            return value
        return _coerce(value, inner[0], where)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping of {_field_list(tp)}, got {value!r}")
        return _from_dict(tp, value, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:  # YAML 1.1 reads 3e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where}={value!r} must be true or false")
    if tp is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}={value!r} must be an integer")
    if tp in (float, str) and not isinstance(value, tp):
        raise ConfigError(f"{where}={value!r} must be a {_type_name(tp)}")
    return value


def _field_list(cls: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _from_dict(cls: Any, data: dict[str, Any], where: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in names]
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            [f"unknown key {prefix}{k}: valid keys{' of ' + where if where else ''} are {_field_list(cls)}" for k in unknown]
        )
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ConfigError([f"{where}.{n} is required" for n in missing])
    kwargs = {k: _coerce(v, hints[k], f"{where}.{k}" if where else k) for k, v in data.items()}
    return cls(**kwargs)


def _apply_override(data: dict[str, Any], assignment: str) -> None:
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r} is not key=value: write e.g. --set train.lr=3e-4")
    key, raw = assignment.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"--set {assignment!r} has an empty key part: write e.g. --set train.lr=3e-4")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML ({e.problem})") from None
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {part} is not a section")
    node[parts[-1]] = value


DURABLE_ENV = "ELASTIC_LLM_DURABLE_PATH"  # durable.storage_path: cluster reads it


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Read a YAML run config, apply ``key=value`` overrides, validate.

    Raises :class:`ConfigError` for a missing/unparseable file, unknown keys, wrong types and
    invalid values.
    """
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist: pass --config with a YAML file such as jobs/tiny.yaml")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping with sections {_field_list(RunConfig)}")
        data = loaded or {}
    for assignment in overrides:
        _apply_override(data, assignment)
    return validate(_with_policy(_cluster_paths(_from_dict(RunConfig, data))))


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    return validate(_with_policy(_cluster_paths(_from_dict(RunConfig, data))))


def _with_policy(cfg: RunConfig) -> RunConfig:
    """``recovery.policy``: the named policy's settings put into the config (each change logged)."""
    try:
        policy = named(cfg.recovery.policy)
    except KeyError as e:
        raise ConfigError(str(e.args[0])) from None
    changed = apply_policy(cfg, policy)
    if changed:
        log.info("recovery.policy=%s sets %s", policy.name, "; ".join(changed))
    return cfg


def _cluster_paths(cfg: RunConfig) -> RunConfig:
    """``durable.storage_path: cluster``: the durable location the cluster gives its runs, the
    environment variable :data:`DURABLE_ENV` where the config is read (``cluster.yaml`` sets it on
    the head, where a submitted run's driver runs, to an S3 bucket it makes); none where it is unset."""
    if cfg.durable.storage_path == "cluster":
        cfg.durable.storage_path = os.environ.get(DURABLE_ENV) or None
    return cfg


def apply_policy(cfg: RunConfig, policy: Policy) -> list[str]:
    """Set ``policy``'s fields on ``cfg`` (in place) and return ``"field: old -> new"`` for each one it changed."""
    changed = []
    for key, value in policy.settings:
        section, name = key.split(".")
        holder = getattr(cfg, section)
        new = cfg.parallel.dp if value == DP else value
        old = getattr(holder, name)
        if old != new:
            changed.append(f"{key}: {old!r} -> {new!r}")
            setattr(holder, name, new)
    return changed
