"""cluster.yaml passes Ray's own cluster-config checks, offline (no AWS calls).

``ray up`` runs ``prepare_config`` (fill in defaults) and then ``validate_config`` (the JSON
schema in ray/autoscaler/ray-schema.json plus Ray's own consistency checks); both run here.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def raw():
    with open(os.path.join(REPO, "cluster.yaml")) as fh:
        return yaml.safe_load(fh)


@pytest.fixture(scope="module")
def prepared(raw):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(copy.deepcopy(raw))
    validate_config(config)
    return config


def test_raw_file_matches_rays_schema(raw):
    """No unknown or misspelled fields, before any defaults are filled in."""
    import ray.autoscaler

    with open(os.path.join(os.path.dirname(ray.autoscaler.__file__), "ray-schema.json")) as fh:
        schema = json.load(fh)
    jsonschema.validate(raw, schema)


def test_prepare_and_validate_like_ray_up(prepared):
    assert prepared["provider"]["type"] == "aws"
    assert prepared["provider"]["region"]
    assert prepared["head_node_type"] in prepared["available_node_types"]


def test_cpu_head_and_gpu_workers(prepared):
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0
    assert head["node_config"]["InstanceType"].split(".")[0][0] in "mct"  # a CPU family (m5, c6i, t3...)
    workers = [t for name, t in types.items() if name != prepared["head_node_type"]]
    assert workers and all(t["resources"].get("GPU", 0) >= 1 for t in workers)
    assert all(t["node_config"]["InstanceType"].startswith(("g4dn", "g5", "g6", "p3", "p4", "p5")) for t in workers)
    assert all(0 <= t["min_workers"] <= t["max_workers"] <= prepared["max_workers"] for t in workers)


def test_setup_installs_this_package_with_its_object_store_extra(prepared):
    commands = "\n".join(prepared["setup_commands"])
    assert "raytrain_events[s3" in commands
    assert "ray[default" in commands
    # the checkout is copied to the nodes for the editable install
    assert any(path.endswith("raytrain_events") for path in prepared["file_mounts"])


def test_start_commands_present(prepared):
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP" in c for c in prepared["worker_start_ray_commands"])


def test_file_documents_what_to_edit():
    with open(os.path.join(REPO, "cluster.yaml")) as fh:
        text = fh.read()
    for topic in ("region", "InstanceType", "max_workers", "bucket", "EDIT"):
        assert topic in text


def test_checkout_cannot_shadow_the_installed_package(raw):
    """`ray submit` runs `python ~/SCRIPT` (~ first on sys.path): no ~/raytrain_events folder, a non-editable install."""
    for remote in raw["file_mounts"]:
        parent = os.path.dirname(remote.rstrip("/"))
        assert parent not in ("~", "/home/ubuntu", "/root"), f"{remote} would shadow the installed package"
    commands = "\n".join(raw["setup_commands"] + raw["head_setup_commands"] + raw["worker_setup_commands"])
    assert "install -e" not in commands and "--editable" not in commands


def test_one_resolve_with_the_repository_pins(raw):
    """Every pip install is one resolve against constraints.txt (boto3 in it: no later upgrade past aiobotocore's pin)."""
    installs = [
        c
        for c in raw["setup_commands"] + raw["head_setup_commands"] + raw["worker_setup_commands"]
        if "pip install" in c and "--upgrade pip" not in c
    ]
    assert len(installs) == 1, installs
    assert "constraints.txt" in installs[0] and "boto3" in installs[0] and "raytrain_events[s3" in installs[0]
    with open(os.path.join(REPO, "constraints.txt")) as fh:
        pins = {line.split("==")[0] for line in fh if "==" in line and not line.startswith("#")}
    assert {"ray", "torch", "s3fs", "aiobotocore", "botocore", "boto3"} <= pins


def test_token_auth_and_dashboard_on_loopback(raw):
    assert "~/.ray/auth_token" in raw["file_mounts"]
    assert any("RAY_AUTH_MODE=token" in c for c in raw["setup_commands"])
    head = " ".join(raw["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head and "0.0.0.0" not in head
