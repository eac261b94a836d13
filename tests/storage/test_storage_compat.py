"""The private fsspec/s3fs names raytrain_events relies on: all still there, all used through storage/_compat.py.

An fsspec or s3fs upgrade that renames one fails `test_every_private_storage_name_is_still_there`
naming the library, its version and the name, instead of a checkpoint upload failing later.
"""

from __future__ import annotations

import ast
from pathlib import Path

from raytrain_events.storage import _compat

PACKAGE = Path(__file__).resolve().parents[2] / "raytrain_events"
PRIVATE = {attr for _, _, attr in _compat.NAMES.values()}


def test_every_private_storage_name_is_still_there():
    assert _compat.check_private_names() == []


def test_a_missing_name_fails_naming_the_library_and_version(monkeypatch):
    monkeypatch.setitem(_compat.NAMES, "gone", ("fsspec.spec", "AbstractFileSystem", "_renamed_later"))
    problems = dict(_compat.check_private_names())
    assert list(problems) == ["gone"] and "fsspec " in problems["gone"]
    assert "has no AbstractFileSystem._renamed_later" in problems["gone"]


def test_no_private_storage_name_outside_the_compat_table():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == PACKAGE / "storage" / "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: .{node.attr}")
            if isinstance(node, ast.Constant) and node.value in PRIVATE:  # getattr(cls, "_pipe_file", ...)
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    assert not offenders, "private fsspec/s3fs names outside storage/_compat.py:\n" + "\n".join(offenders)


def test_the_wrappers_reach_the_same_calls(s3_server):
    from fsspec.asyn import sync

    from raytrain_events.storage.fs import read_many, resolve

    url = f"s3://{s3_server['bucket']}/compat/a.bin"
    fs, path = resolve(url, s3_server["storage_options"])
    fs.pipe(path, b"abc")
    assert _compat.strip_protocol(fs, url) == path.rstrip("/")
    assert read_many(fs, [path]) == {path: b"abc"}  # keyed through strip_protocol
    head = sync(fs.loop, _compat.call_s3, fs, "head_object", **_key(path))
    assert head["ContentLength"] == 3


def _key(path):
    bucket, key = path.split("/", 1)
    return {"Bucket": bucket, "Key": key}
