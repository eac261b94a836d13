"""``runs ls``, ``inspect`` and ``diff``: look at run directories on any storage.

A run directory is ``<storage>/<run_name>`` holding any of ``config.yaml`` (the run's config),
``summary.json`` (written when a job such as the digits example ends, see `raytrain_events.cli.summary`)
and ``checkpoints/`` (committed checkpoints, each with the global Timestamp it was saved at).
"""

from __future__ import annotations

import datetime
import json
from typing import Any, Dict, List, Optional, Sequence

from raytrain_events.cli.errors import UsageError
from raytrain_events.core.time import COUNTER_UNITS
from raytrain_events.storage.config_diff import format_config_diff
from raytrain_events.storage.exp_dir import CHECKPOINTS_DIR, CONFIG_FILE, SUMMARY_FILE, RunDir, checkpoints_url
from raytrain_events.storage.fs import basename, join, list_dir, read_bytes, resolve, to_url
from raytrain_events.storage.locks import read_lock

__all__ = ["parse_storage_options", "list_runs", "inspect_run", "diff_runs"]

_TIME_KEYS = tuple(COUNTER_UNITS)


def parse_storage_options(items: Optional[Sequence[str]]) -> Dict[str, Any]:
    """``["key=value", "client_kwargs.endpoint_url=http://..."]`` -> a nested dict for fsspec."""
    if not items:
        return {}
    from omegaconf import OmegaConf

    for item in items:
        if "=" not in item:
            raise UsageError(
                f"--storage-option expects KEY=VALUE (like client_kwargs.endpoint_url=http://127.0.0.1:9000), got {item!r}."
            )
    try:
        return OmegaConf.to_container(OmegaConf.from_dotlist(list(items)), resolve=True)
    except Exception as exc:
        raise UsageError(f"Cannot parse --storage-option {list(items)}: {exc}") from None


def _guard(url: str, what: str, fn):
    from raytrain_events.checkpoint.format.manifest import CheckpointError  # why here: checkpoint/ imports torch

    try:
        return fn()
    except (UsageError, FileNotFoundError):
        raise
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    except CheckpointError as exc:
        raise UsageError(f"Cannot read the checkpoints of {url!r}: {exc}") from None
    except Exception as exc:
        raise UsageError(f"Cannot {what} {url!r}: {type(exc).__name__}: {exc}") from None


def _read_json(url: str, options: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    fs, path = resolve(url, options)
    try:
        return json.loads(read_bytes(fs, path))
    except FileNotFoundError:
        return None
    except ValueError:
        return {"error": f"{url} is not valid JSON"}


def _load_config(run_url: str, options: Dict[str, Any]) -> Any:
    try:
        return RunDir(run_url, options).load_config()
    except FileNotFoundError:
        return None


def _run_info(run_url: str, options: Dict[str, Any]) -> Dict[str, Any]:
    from raytrain_events.checkpoint.folder.store import list_checkpoints  # why here: imports torch

    checkpoints = list_checkpoints(checkpoints_url(run_url), storage_options=options)
    summary = _read_json(join(run_url, SUMMARY_FILE), options)
    return {
        "run_url": run_url,
        "status": _status(run_url, options, summary),
        "checkpoints": [
            {
                "name": c.name,
                "url": c.url,
                "timestamp": {k: c.timestamp.get(k, 0) for k in _TIME_KEYS},
                "created": c.created,
                "world_size": c.world_size,
                "bytes": sum(f.size for f in c.files),
            }
            for c in checkpoints
        ],
        "summary": summary,
    }


def _status(run_url: str, options: Dict[str, Any], summary: Optional[Dict[str, Any]]) -> str:
    """running (a live ``running`` lock), finished (summary.json), or ended (neither: failed,
    interrupted, or not a digits-job run, which are the ones that write summary.json)."""
    lock = read_lock(run_url, "running", storage_options=options)
    if lock is not None:
        stale = lock.stale_reason()
        return f"running ({lock.describe()})" if stale is None else f"ended (stale running lock: {stale})"
    return "finished" if summary else "ended"


def list_runs(storage: str, options: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every run directory directly under ``storage``, sorted by name."""

    def scan() -> List[Dict[str, Any]]:
        fs, root = resolve(storage, options)
        if not fs.exists(root):
            raise UsageError(f"Storage {storage!r} does not exist (nothing has been written there yet?).")
        runs = []
        for entry in sorted(list_dir(fs, root), key=lambda e: e["name"]):
            if entry.get("type") != "directory":
                continue
            names = {basename(e["name"]) for e in list_dir(fs, entry["name"])}
            if not names & {CONFIG_FILE, SUMMARY_FILE, CHECKPOINTS_DIR, "running"}:
                continue
            url = to_url(fs, entry["name"])
            info = _run_info(url, options)
            info["name"] = basename(entry["name"])
            info["has_config"] = CONFIG_FILE in names
            runs.append(info)
        return runs

    return _guard(storage, "list runs under", scan)


def format_runs(runs: List[Dict[str, Any]], storage: str) -> str:
    if not runs:
        return f"No runs under {storage} (a run directory holds config.yaml, summary.json or checkpoints/)."
    rows = [("RUN", "STATUS", "CHECKPOINTS", "LATEST CHECKPOINT", "FINAL TIMESTAMP", "EVAL ACCURACY")]
    for run in runs:
        latest = run["checkpoints"][-1]["timestamp"] if run["checkpoints"] else None
        summary = run["summary"] or {}
        final = summary.get("timestamp")
        accuracy = (summary.get("metrics") or {}).get("metrics/eval/accuracy")
        rows.append(
            (
                run["name"],
                run["status"].split(" (")[0],
                str(len(run["checkpoints"])),
                _ts(latest) if latest else "-",
                _ts(final) if final else "-",
                f"{accuracy:.4f}" if isinstance(accuracy, float) else "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def inspect_run(run_url: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The run's config (as a plain dict), summary and checkpoints."""
    from omegaconf import OmegaConf

    def read() -> Dict[str, Any]:
        info = _run_info(run_url, options)
        config = _load_config(run_url, options)
        info["config"] = None if config is None else OmegaConf.to_container(config, resolve=False)
        if config is None and info["summary"] is None and not info["checkpoints"]:
            raise UsageError(
                f"No run at {run_url!r}: it has no config.yaml, summary.json or checkpoints/. "
                "List the runs with `raytrain-events runs ls <storage>`."
            )
        return info

    return _guard(run_url, "inspect", read)


def format_inspect(info: Dict[str, Any]) -> str:
    from omegaconf import OmegaConf

    lines = [f"Run {info['run_url']}", f"status: {info['status']}"]
    summary = info["summary"]
    if summary and "timestamp" in summary:
        lines.append(f"finished at {_ts(summary['timestamp'])} in {summary.get('wall_seconds', '?')}s")
        for key, value in sorted((summary.get("metrics") or {}).items()):
            if key.startswith(("train/", "metrics/")):
                lines.append(f"  {key}: {value:.4f}" if isinstance(value, float) else f"  {key}: {value}")
    else:
        lines.append("no summary.json (the run has not finished, or it failed)")
    lines.append("")
    if info["checkpoints"]:
        lines.append(f"checkpoints ({len(info['checkpoints'])}, oldest first):")
        rows = [("NAME", "EPOCH", "BATCH", "SAMPLE", "TOKEN", "SAVED", "SIZE")]
        for c in info["checkpoints"]:
            ts = c["timestamp"]
            saved = datetime.datetime.fromtimestamp(c["created"]).strftime("%Y-%m-%d %H:%M:%S")
            rows.append((c["name"], *(str(ts[k]) for k in _TIME_KEYS), saved, _size(c["bytes"])))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    else:
        lines.append("checkpoints: none")
    lines.append("")
    if info["config"] is None:
        lines.append("config: no config.yaml")
    else:
        lines.append("config (config.yaml):")
        lines += ["  " + line for line in OmegaConf.to_yaml(OmegaConf.create(info["config"])).rstrip().splitlines()]
    return "\n".join(lines)


def diff_runs(run_a: str, run_b: str, options: Dict[str, Any]) -> str:
    """``- key: value_in_a`` / ``+ key: value_in_b`` lines ('' when the configs are equal)."""
    configs = []
    for url in (run_a, run_b):
        config = _guard(url, "read the config of", lambda url=url: _load_config(url, options))
        if config is None:
            raise UsageError(
                f"No config.yaml in {url!r}: is it a run directory? (`raytrain-events runs ls <storage>` lists them.)"
            )
        configs.append(config)
    return format_config_diff(*configs)


def _ts(ts: Dict[str, Any]) -> str:
    """``{"epoch": 2, "batch": 24, ...}`` -> ``2ep 24ba 3000sp 0tok`` (Time strings)."""
    return " ".join(f"{ts.get(name, 0)}{unit.value}" for name, unit in COUNTER_UNITS.items())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n}B"
