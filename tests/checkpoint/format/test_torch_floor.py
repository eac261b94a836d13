"""The safety promise's torch floor: loads refuse a torch whose weights-only unpickler has a known bypass.

``pyproject.toml`` requires torch>=2.10; ``checkpoint/format/safety.py`` catches installs that went around
it. Both ways: this torch loads; a (patched) 2.9 is refused before any byte is read, naming the
advisory and the fix, for a plain checkpoint and for the sharded (DCP) reader.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from raytrain_events.checkpoint.dcp.safe_dcp import SafeDCPReader
from raytrain_events.checkpoint.format import safety
from raytrain_events.checkpoint.format.manifest import UnsafeCheckpointError
from raytrain_events.checkpoint.format.reader import read_checkpoint
from raytrain_events.checkpoint.format.writer import write_checkpoint


def test_pyproject_requires_the_safe_torch():
    text = (Path(__file__).parents[3] / "pyproject.toml").read_text()  # tomllib is 3.11+, we support 3.10
    (torch_dep,) = re.findall(r'^\s*"torch>=\s*(\d+)\.(\d+)', text, flags=re.M)
    floor = tuple(int(x) for x in torch_dep)
    assert floor >= safety.SAFE_TORCH
    assert safety._parse(torch.__version__) >= safety.SAFE_TORCH  # this environment honours it


def test_this_torch_loads(tmp_path):
    info = write_checkpoint(
        str(tmp_path), files={"state.pt": {"w": torch.ones(2)}}, timestamp={"batch": 1}, world_size=1
    )
    assert torch.equal(read_checkpoint(info.url).files["state.pt"]["w"], torch.ones(2))


@pytest.mark.parametrize("version", ["2.9.1+cpu", "2.5.1", "1.13.0"])
def test_an_old_torch_is_refused_naming_the_advisory_and_fix(tmp_path, monkeypatch, version):
    info = write_checkpoint(
        str(tmp_path), files={"state.pt": {"w": torch.ones(2)}}, timestamp={"batch": 1}, world_size=1
    )
    monkeypatch.setattr(safety, "_torch_version", lambda: version)
    loads: list = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))
    with pytest.raises(UnsafeCheckpointError) as e:
        read_checkpoint(info.url)
    msg = str(e.value)
    assert "GHSA-63cw-57p8-fm3p" in msg and version in msg and "pip install 'torch>=2.10'" in msg
    assert loads == []  # refused before torch.load saw a byte
    with pytest.raises(UnsafeCheckpointError, match="GHSA-63cw-57p8-fm3p"):
        SafeDCPReader(str(tmp_path)).read_metadata()


def test_version_parsing():
    assert safety._parse("2.10.0") == (2, 10) and safety._parse("2.13.0+cpu") == (2, 13)
    assert safety._parse("2.10.0a0+git1234") >= safety.SAFE_TORCH and safety._parse("garbage") < safety.SAFE_TORCH
