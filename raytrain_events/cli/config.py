"""Config loading for the CLI and the examples: a dataclass schema, a YAML file, ``key=value`` overrides.

The schema is a dataclass whose fields carry ``metadata={"help": ...}`` (shown by ``--help``),
optionally ``"time": True`` (a `Time` string, checked with the `Time` parser; ``"dur": False``
refuses fractions of the run) and ``"choices": [...]``. `load_config` layers schema defaults <-
YAML file <- overrides (OmegaConf.from_dotlist syntax), and turns every mistake into a
`UsageError` naming the accepted keys, types or forms.

Usage::

    cfg = load_config(DigitsConfig, config_path="examples/configs/digits.yaml",
                      overrides=["num_workers=4", "max_duration=3ep"])
"""

from __future__ import annotations

import dataclasses
import difflib
import textwrap
import typing
from typing import Any, Dict, List, Optional, Sequence, Tuple

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from raytrain_events.cli.errors import UsageError
from raytrain_events.core.plain import to_plain as _to_plain
from raytrain_events.core.time import TimeUnit, ensure_time

__all__ = ["load_config", "describe_keys", "keys_help", "to_plain"]


def load_config(schema: type, *, config_path: Optional[str] = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Schema defaults, then the YAML file at ``config_path``, then ``key=value`` overrides."""
    layers = [OmegaConf.structured(schema)]
    if config_path is not None:
        layers.append(_read_yaml(config_path, schema))
    if overrides:
        layers.append(_parse_overrides(overrides, schema))
    try:
        cfg = OmegaConf.merge(*layers)
    except OmegaConfBaseException as exc:
        raise UsageError(_explain_merge_error(exc, schema)) from None
    _check_values(cfg, schema)
    return cfg


def to_plain(cfg: Any) -> Dict[str, Any]:
    """A plain dict (for JSON, Ray and logs) from a DictConfig."""
    return _to_plain(cfg, fallback=lambda value: value)


# ----------------------------------------------------------------------------- describing
def describe_keys(schema: type, prefix: str = "") -> List[Tuple[str, Any, str]]:
    """``(dotted key, default, help)`` for every leaf key of ``schema``, in declaration order."""
    out: List[Tuple[str, Any, str]] = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key = prefix + f.name
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            out += describe_keys(sub, key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        out.append((key, default, f.metadata.get("help", "")))
    return out


def keys_help(schema: type) -> str:
    """The config keys as help text: ``key (default: value)`` then the description."""
    lines = []
    for key, default, text in describe_keys(schema):
        shown = _flow(default)
        lines.append(f"  {key} (default: {shown})")
        if text:
            lines.append(f"      {text}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- loading
def _read_yaml(path: str, schema: type) -> DictConfig:
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise UsageError(f"Cannot read config file {path!r}: {exc.strerror or exc}.") from None
    try:
        data = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except Exception as exc:  # yaml.YAMLError and OmegaConf errors
        raise UsageError(f"Config file {path!r} is not valid YAML: {exc}") from None
    if not isinstance(data, DictConfig):
        raise UsageError(f"Config file {path!r} must hold a mapping of keys to values, not a {type(data).__name__}.")
    _check_keys(OmegaConf.to_container(data, resolve=False), schema, "", f"config file {path}")
    return data


def _parse_overrides(overrides: Sequence[str], schema: type) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise UsageError(
                f"Expected a key=value override, got {item!r}. Examples: num_workers=4 max_duration=3ep "
                "'algorithms=[label_smoothing]'. Valid keys:\n" + _valid_keys_text(schema, "")
            )
    try:
        data = OmegaConf.from_dotlist(list(overrides))
    except Exception as exc:
        raise UsageError(f"Cannot parse the overrides {list(overrides)}: {exc}") from None
    _check_keys(OmegaConf.to_container(data, resolve=False), schema, "", "the command line")
    return data


def _check_keys(data: Any, schema: type, prefix: str, where: str) -> None:
    if not isinstance(data, dict):
        raise UsageError(f"{prefix.rstrip('.') or 'The config'} from {where} must be a mapping, got {data!r}.")
    hints = typing.get_type_hints(schema)
    names = [f.name for f in dataclasses.fields(schema)]
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" Did you mean {prefix + close[0]!r}?" if close else ""
            raise UsageError(
                f"Unknown config key {prefix + str(key)!r} (from {where}).{hint} Valid keys:\n"
                + _valid_keys_text(schema, prefix)
            )
        sub = _dataclass_of(hints[key])
        if sub is not None and value is not None:
            _check_keys(value, sub, f"{prefix}{key}.", where)


def _valid_keys_text(schema: type, prefix: str) -> str:
    keys = ", ".join(f"{prefix}{key}" for key, _, _ in describe_keys(schema))
    return textwrap.fill(keys, width=100, initial_indent="  ", subsequent_indent="  ")


def _check_values(cfg: DictConfig, schema: type, prefix: str = "") -> None:
    """Time strings through the `Time` parser, choices against their list."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        key, value = prefix + f.name, cfg.get(f.name)
        sub = _dataclass_of(hints[f.name])
        if sub is not None:
            _check_values(value, sub, key + ".")
            continue
        if value is None:
            continue
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise UsageError(f"{key}={value!r} is not one of the accepted values: {', '.join(map(str, choices))}.")
        if f.metadata.get("time"):
            try:
                time = ensure_time(value, TimeUnit.EPOCH)
            except (ValueError, TypeError) as exc:
                hint = ""
                try:
                    float(value)
                    hint = f" A bare number has no unit: add one, like {value}ep or {value}tok."
                except ValueError:
                    pass
                raise UsageError(f"{key}={value!r} is not a duration. {exc}.{hint}") from None
            if time.unit == TimeUnit.DURATION and not f.metadata.get("dur", True):
                raise UsageError(
                    f"{key}={value!r} is a fraction of the run ('dur'); give it in 'ep', 'ba', 'sp' or 'tok', like '10ep'."
                )
            if time.value <= 0 and not f.metadata.get("zero_ok", False):
                raise UsageError(f"{key}={value!r} must be positive, like '10ep'.")


def _explain_merge_error(exc: OmegaConfBaseException, schema: type) -> str:
    key = getattr(exc, "full_key", None) or ""
    expected = ""
    for dotted, _default, _ in describe_keys(schema):
        if dotted == key:
            expected = _type_name(schema, key)
    message = (getattr(exc, "msg", None) or str(exc)).strip().splitlines()[0]
    if key:
        return f"Bad value for config key {key!r}: {message}" + (f" (expected {expected})." if expected else "")
    return f"Invalid config: {message}"


def _type_name(schema: type, dotted: str) -> str:
    parts = dotted.split(".")
    for part in parts[:-1]:
        schema = _dataclass_of(typing.get_type_hints(schema)[part]) or schema
    hint = typing.get_type_hints(schema).get(parts[-1])
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _dataclass_of(hint: Any) -> Optional[type]:
    """The dataclass type behind ``hint`` (also inside Optional[...]), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    for arg in typing.get_args(hint):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _flow(value: Any) -> str:
    """A value in YAML flow style, as it would be typed in a key=value override."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    return _yaml_scalar(value)


def _yaml_scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
