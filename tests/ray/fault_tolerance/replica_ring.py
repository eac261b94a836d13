"""One replica group's process for `test_replica_abort.py` (no Ray): torchft's Manager and the loop's commit-gated
optimizer, as a Ray worker builds them (`build_manager`, `CommitOptimizer`), training a small model step by step.

``python tests/ray/fault_tolerance/replica_ring.py GROUP GROUPS FOLDER LIGHTHOUSE [TIMEOUT_S]``: writes one JSON line
per step to ``FOLDER/steps-GROUP.jsonl``; SIGKILLs itself between its backward and the step's all-reduce when
``FOLDER/die-GROUP`` exists; stops when ``FOLDER/done`` exists.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from types import SimpleNamespace


def main(group: int, groups: int, folder: str, lighthouse: str, timeout_s: float = 60.0) -> None:
    import torch
    from torch.distributed import TCPStore

    from raytrain_events.core.time import Timestamp
    from raytrain_events.ray.replica_checks import min_replicas
    from raytrain_events.ray.replica_groups import CommitOptimizer, ReplicaState, build_manager

    with socket.socket() as s:  # this group's own store, as Ray's world of one hosts it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCHFT_LIGHTHOUSE=lighthouse)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    inner = torch.optim.SGD(model.parameters(), lr=0.01)
    replicas = ReplicaState()
    replicas.model, replicas.optimizer = model, inner
    replicas.state = SimpleNamespace(timestamp=Timestamp())
    manager, watch = build_manager(replicas, group, "ring", min_replicas(groups), timeout_s)
    optimizer = CommitOptimizer(manager, inner, watch)
    out = open(os.path.join(folder, f"steps-{group}.jsonl"), "a")
    step = 0
    while not os.path.exists(os.path.join(folder, "done")):
        manager.start_quorum()
        participants = manager.num_participants()
        loss = model(torch.randn(32, 64)).square().mean()
        loss.backward()
        if os.path.exists(os.path.join(folder, f"die-{group}")):
            os.kill(os.getpid(), signal.SIGKILL)
        started = time.time()
        optimizer.step()
        inner.zero_grad()
        record = dict(
            group=group,
            pid=os.getpid(),
            step=step,
            participants=participants,
            committed=optimizer.committed,
            abandoned=watch.abandoned,
            started=started,
            t=time.time(),
        )
        out.write(json.dumps(record) + "\n")
        out.flush()
        step += 1
        time.sleep(0.05)
    manager.shutdown(wait=False)
    os._exit(0)  # the abandoned all-reduce's process group may still wait on gloo's timeout: do not join it


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], *map(float, sys.argv[5:6]))
