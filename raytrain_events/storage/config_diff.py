"""Line-oriented differences between two configs (e.g. a resumed run's saved vs. new config).

Modelled on ml-starter's ``diff_configs``: recursive over DictConfig / ListConfig / dict /
list; each side gets lines ``dotted.key: value`` for values that differ or keys only it has.
Configs are compared *unresolved* (interpolations as written, ``???`` for missing values),
so diffing never fails on an interpolation that cannot be resolved here.

Usage::

    old, new = diff_configs(saved_cfg, cfg)         # ["model.hidden: 64"], ["model.hidden: 128"]
    print(format_config_diff(saved_cfg, cfg))       # "- model.hidden: 64\\n+ model.hidden: 128"
"""

from __future__ import annotations

import json
from typing import Any

from raytrain_events.core.plain import to_plain

_ABSENT = object()


def diff_configs(first: Any, second: Any, prefix: str | None = None) -> tuple[list[str], list[str]]:
    """Return ``(lines_only_in_first, lines_only_in_second)``; both empty when equal."""
    first_lines: list[str] = []
    second_lines: list[str] = []
    for key, old, new in _diff(_plain(first), _plain(second), prefix):
        if old is not _ABSENT:
            first_lines.append(_line(key, old))
        if new is not _ABSENT:
            second_lines.append(_line(key, new))
    return first_lines, second_lines


def format_config_diff(first: Any, second: Any) -> str:
    """The differences as ``- key: old`` / ``+ key: new`` lines ('' when the configs match)."""
    out: list[str] = []
    for key, old, new in _diff(_plain(first), _plain(second), None):
        if old is not _ABSENT:
            out.append(f"- {_line(key, old)}")
        if new is not _ABSENT:
            out.append(f"+ {_line(key, new)}")
    return "\n".join(out)


def _diff(a: Any, b: Any, prefix: str | None) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in list(a) + [k for k in b if k not in a]:
            sub = str(key) if prefix is None else f"{prefix}.{key}"
            out += _diff(a.get(key, _ABSENT), b.get(key, _ABSENT), sub)
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = []
        for i in range(max(len(a), len(b))):
            sub = str(i) if prefix is None else f"{prefix}.{i}"
            out += _diff(a[i] if i < len(a) else _ABSENT, b[i] if i < len(b) else _ABSENT, sub)
        return out
    if a is _ABSENT or b is _ABSENT or type(a) is not type(b) or a != b:
        return [("<root>" if prefix is None else prefix, a, b)]
    return []


def _line(key: str, value: Any) -> str:
    return f"{key}: {_fmt(value)}"


def _fmt(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def _plain(cfg: Any) -> Any:
    """Configs (OmegaConf, dataclasses, dicts) as plain data, interpolations left as written."""
    return to_plain(cfg, fallback=lambda value: value, resolve=False)
