"""Run by tests/ray/test_loopback.py in a subprocess WITHOUT RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER.

Imports ``ray`` first (so Ray has read its environment before raytrain_events touches anything),
starts the embedded instance with `ensure_ray`, runs one task, and prints (as JSON) every
address Ray reports and every socket address of this process and all processes it started.

Guard: ``ray.init`` is wrapped so that, if at the moment it is called Ray would give the node
a non-loopback address (the fix regressed), it exits with code 3 before anything starts or binds.
"""

import importlib
import json
import os
import sys

assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ, "run me without the variable (env -u ...)"

import psutil  # noqa: E402
import ray  # noqa: E402  (before raytrain_events: the import order that used to defeat the loopback setting)

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}
_real_init = ray.init


def _guarded_init(*args, **kwargs):
    services = importlib.import_module("ray._private.services")
    node_ip = kwargs.get("_node_ip_address")
    planned = services.resolve_ip_for_localhost(node_ip) if node_ip else services.get_node_ip_address()
    env = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    if planned not in LOOPBACK or env != "0":
        print(json.dumps({"refused": {"planned_node_ip": planned, "env": env}}), flush=True)
        os._exit(3)
    return _real_init(*args, **kwargs)


ray.init = _guarded_init

from raytrain_events.ray.cluster import ensure_ray  # noqa: E402

started = ensure_ray(min_cpus=1)  # as RayTrainer.fit starts it (with the dashboard when installed)


@ray.remote(num_cpus=0)
def node_ip_seen_by_a_worker():
    return ray.util.get_node_ip_address()


def _host(address):
    """``http://1.2.3.4:80`` or ``1.2.3.4:80`` -> ``1.2.3.4``."""
    address = address.split("://", 1)[-1]
    host, _, port = address.rpartition(":")
    return host if port.isdigit() else address


worker_ip = ray.get(node_ip_seen_by_a_worker.remote(), timeout=120)
node = ray._private.worker.global_worker.node
reported = {
    "driver node ip": ray.util.get_node_ip_address(),
    "worker node ip": worker_ip,
    "gcs address": ray.get_runtime_context().gcs_address.rsplit(":", 1)[0],
    **{
        f"address_info[{key}]": _host(node.address_info[key])
        for key in ("node_ip_address", "gcs_address", "address", "webui_url")
        if node.address_info.get(key)
    },
    **{f"ray.nodes() {n['NodeID'][:8]}": n["NodeManagerAddress"] for n in ray.nodes()},
}
sockets = []
for proc in [psutil.Process()] + psutil.Process().children(recursive=True):
    try:
        for conn in proc.net_connections(kind="inet"):
            if conn.laddr:
                sockets.append(
                    {
                        "process": proc.name(),
                        "status": conn.status,
                        "ip": conn.laddr.ip,
                        "remote": conn.raddr.ip if conn.raddr else None,
                    }
                )
    except psutil.Error:  # a process that ended meanwhile
        continue
env_after = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
ray.shutdown()
print(json.dumps({"started_local": started, "reported": reported, "sockets": sockets, "env_after": env_after}))
sys.exit(0)
