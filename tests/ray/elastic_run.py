"""An elastic run on a Ray cluster of several raylets on this machine (``ray.cluster_utils.Cluster``,
as Ray's own tests lose and regain nodes), run by ``test_elastic.py`` in its own process.

A head node with 1 CPU (for Ray Data) and two 1-CPU nodes with a ``slot`` resource for the train
workers; ``num_workers=(1, 2)``. While the run trains (in a thread), the main thread removes a worker node once the
2-worker group has trained 6 batches (the group continues on 1 worker), then adds a node back once
the 1-worker group has trained (Ray grows the group to 2 again). Prints one JSON line with the
result for the test to check.

    python tests/ray/elastic_run.py <scratch dir>
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import resume_helpers as h  # noqa: E402


def watch(cluster, nodes, records, events, done):
    """Remove a worker node after 6 batches on 2 workers; add one back after 3 batches on 1.

    Runs on the main thread: Ray's ``Cluster.add_node`` installs signal handlers, which Python
    allows only there (the run itself trains in a background thread).
    """
    removed = added = False
    while not done.is_set() and not added:
        seen = h.read_records(records)
        if not removed and any(r["world"] == 2 and (r["epoch"], r["batch_in_epoch"]) >= (0, 6) for r in seen):
            cluster.remove_node(nodes.pop())
            events.append(("removed", time.time()))
            removed = True
        if removed and sum(r["world"] == 1 for r in seen) >= 3:
            nodes.append(cluster.add_node(num_cpus=1, resources={"slot": 1}))
            events.append(("added", time.time()))
            added = True
        time.sleep(0.5)


def main(scratch: str) -> None:
    import ray
    import ray.data
    from ray import cloudpickle
    from ray.cluster_utils import Cluster
    from ray.train import ScalingConfig

    from raytrain_events import RayTrainer
    from raytrain_events.checkpoint import CheckpointConfig

    cloudpickle.register_pickle_by_value(h)  # the workers get the helpers by value

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    nodes = [cluster.add_node(num_cpus=1, resources={"slot": 1}) for _ in range(2)]
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    data, records = os.path.join(scratch, "data"), os.path.join(scratch, "records")
    os.makedirs(records, exist_ok=True)
    tokens = h.write_parquet(data)
    events: list = []
    outcome: dict = {}
    done = threading.Event()

    def train():
        try:
            outcome["result"] = RayTrainer(
                model=h.make_model,
                optimizers=h.make_sgd,
                datasets={"train": ray.data.read_parquet(data)},
                max_duration="2ep",
                global_batch_size=h.GLOBAL_BATCH,
                get_num_tokens_in_batch=h.count_tokens,
                # num_workers=(1, 2) with a short resize check, so that the test sees the group grow back.
                scaling_config=ScalingConfig(
                    num_workers=(1, 2), resources_per_worker={"CPU": 1, "slot": 1}, elastic_resize_monitor_interval_s=2
                ),
                storage_path=os.path.join(scratch, "runs"),
                run_name="elastic",
                checkpoint=CheckpointConfig(save_interval="3ba", keep=2, save_every_n_seconds=None),
                max_failures=3,
                report_interval="3ba",
                # One worker trains slower: Ray's resize check and a new 2-worker group (~20-30 s on a
                # loaded machine) must come before the run's last batch, or it ends on one worker.
                callbacks=lambda: [h.RecordRows(records, sleep_s=0.4, alone_sleep_s=1.5)],
            ).fit()
        except BaseException as exc:  # re-raised on the main thread
            outcome["error"] = exc
        finally:
            done.set()

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    watch(cluster, nodes, records, events, done)
    trainer.join()
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    lineage = h.assert_every_row_once_per_epoch(records, 2)
    worlds = [lineage[key][0] for key in sorted(lineage)]
    print(
        "ELASTIC_RESULT "
        + json.dumps(
            {
                "timestamp": h.timestamp_of(result),
                "expected": h.expected_timestamp(tokens, 2),
                "worlds": worlds,
                "events": [e for e, _ in events],
                "attempts": max(e["attempt"] for e in result.history),
            }
        ),
        flush=True,
    )
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
