"""The private torch names raytrain_events relies on: all still there, all used through _torch_compat.py.

A torch upgrade that renames or removes one fails `test_every_private_torch_name_is_still_there`
with the torch version and the missing name, instead of a checkpoint save failing later.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from raytrain_events import _torch_compat

PACKAGE = Path(__file__).resolve().parents[1] / "raytrain_events"
# ``torch.x._y`` / ``torch._y`` in code, or ``from torch... import _y`` / ``from torch._x import ...``.
_PRIVATE = re.compile(r"(?<![\w.\"'])torch(?:\.\w+)*\._[a-z]\w*|^\s*from\s+torch(?:\.\w+)*\s+import\s+(?:\(\s*)?_\w+")


def test_every_private_torch_name_is_still_there():
    problems = _torch_compat.check_private_names()
    assert not problems, f"torch {torch.__version__} lacks private names raytrain_events relies on:\n" + "\n".join(
        f"- {name}: {message}" for name, message in problems
    )
    assert _torch_compat.FsspecReader.__name__ == "FsspecReader"  # resolved on first use


def test_a_missing_member_of_a_dcp_class_fails_naming_it(monkeypatch):
    monkeypatch.setitem(_torch_compat.MEMBERS, "FsspecReader", ("fs", "storage_data", "renamed_member"))
    problems = dict(_torch_compat.check_private_names())
    assert list(problems) == ["FsspecReader.renamed_member"]
    assert "instances have no 'renamed_member'" in problems["FsspecReader.renamed_member"]


def test_a_missing_name_fails_naming_the_torch_version(monkeypatch):
    monkeypatch.setitem(_torch_compat.NAMES, "gone", ("torch.distributed.checkpoint", "_renamed_in_a_later_torch"))
    problems = dict(_torch_compat.check_private_names())
    assert list(problems) == ["gone"]
    assert (
        f"torch {torch.__version__} has no torch.distributed.checkpoint._renamed_in_a_later_torch" in problems["gone"]
    )
    with pytest.raises(_torch_compat.TorchCompatError, match=rf"torch {re.escape(torch.__version__)} has no"):
        _torch_compat.gone  # noqa: B018
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        _torch_compat.nothing  # noqa: B018


def test_no_private_torch_name_outside_torch_compat():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_torch_compat.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _PRIVATE.search(code):
                offenders.append(f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}")
    assert not offenders, "private torch names used outside raytrain_events/_torch_compat.py:\n" + "\n".join(offenders)
