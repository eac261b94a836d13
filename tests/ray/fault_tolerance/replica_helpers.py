"""The replica-groups test's recorder (a module of its own: Ray workers import it by name)."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

from raytrain_events import Callback


def live_procs(folder: str) -> list:
    """The ``proc-*.json`` records in ``folder`` of the processes still alive (the kill tests' targets)."""
    out = []
    for path in glob.glob(os.path.join(folder, "proc-*.json")):
        try:
            with open(path) as f:
                info = json.load(f)  # empty while its process is still writing it
            os.kill(info["pid"], 0)
        except (OSError, ValueError):
            continue
        out.append(info)
    return out


class RecordCommits(Callback):
    """Per step, after the commit decision: the global batch's ids and this group's part (one file per process).

    Sleeps ``sleep_s`` per step until ``<folder>/done`` exists, so the run outlasts the kills however
    slow a rejoin is on a loaded machine."""

    def __init__(self, folder: str, sleep_s: float) -> None:
        self.folder, self.sleep_s = folder, sleep_s

    def fit_start(self, state, logger) -> None:
        import ray.train

        self.group = ray.train.get_context().get_world_rank()
        self.group_rank0 = state.rank == 0  # this group's first worker: the one that commits its saves
        self.file = open(os.path.join(self.folder, f"rows-{os.getpid()}.jsonl"), "a")
        self.commit = next(c for c in state.callbacks if type(c).__name__ == "ReplicaCommit")
        with open(os.path.join(self.folder, f"proc-{os.getpid()}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "group": self.group, "t": time.time()}, f)
        self._die_in_recovery(self.commit.loader.replicas.model)
        from raytrain_events.checkpoint.run.checkpointer import find_checkpointer

        self.checkpointer = find_checkpointer(state)
        self.saves = 0
        self.manifests: set = set()  # the names of this process's saves whose manifest it recorded
        self.first_step = True
        if self.checkpointer is not None and state.rank == 0:
            self._die_in_save(self.checkpointer.committer)

    def _log(self, kind: str, record: dict) -> None:
        record.update(pid=os.getpid(), group=self.group, t=time.time())
        with open(os.path.join(self.folder, f"{kind}-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def _record_saves(self, state) -> None:
        """One ``saves-<pid>`` line per checkpoint this process saved (after the `Checkpointer`, the first
        callback, has run for the event)."""
        if self.checkpointer is not None and len(self.checkpointer.saved) > self.saves:
            self.saves = len(self.checkpointer.saved)
            saved = self.checkpointer.saved[-1]
            self._log(
                "saves", {"batch": int(state.timestamp.batch), "name": saved.name, "late_for": list(saved.late_for)}
            )

    def batch_checkpoint(self, state, logger) -> None:
        self._record_saves(state)
        self._record_manifests()

    def _record_manifests(self, wait: bool = False) -> None:
        """One ``manifests-<pid>`` line per checkpoint this process committed, read back from storage once its save
        finished (each batch: before ``keep`` prunes it): its batch, Timestamp and ``late_for`` (a late save)."""
        from raytrain_events.checkpoint.format.reader import read_manifest

        for saved in self.checkpointer.saved if self.checkpointer is not None and self.group_rank0 else []:
            if saved.name in self.manifests or not (wait or saved.future.done()):
                continue
            self.manifests.add(saved.name)
            try:
                saved.wait()
                info = read_manifest(saved.url)
            except Exception as e:  # not committed (this test's saves do not fail) or pruned meanwhile
                self._log("manifests", {"name": saved.name, "error": f"{type(e).__name__}: {e}"})
                continue
            record = {"name": info.name, "batch": info.batch, "timestamp": info.timestamp}
            self._log("manifests", dict(record, late_for=info.metadata.get("late_for")))

    def _die_in_save(self, committer) -> None:
        """Die while writing a save when the test asks (``die-in-save-<group>``): the save's files are written, its
        manifest is not (a half-written checkpoint); then the training thread dies mid-step (``die-in-step``) while
        this upload waits, as a lead killed during a slow upload."""
        upload, flag = committer._upload, os.path.join(self.folder, f"die-in-save-{self.group}")

        def upload_or_die(save, files, entries):
            if not os.path.exists(flag):
                return upload(save, files, entries)
            os.remove(flag)
            from raytrain_events.checkpoint.format.writer import write_checkpoint_file

            written = [write_checkpoint_file(save.location, name, obj).name for name, obj in files.items()]
            died = {"pid": os.getpid(), "url": save.url, "batch": save.timestamp["batch"], "files": written}
            with open(os.path.join(self.folder, f"died-in-save-{os.getpid()}.json"), "w") as f:
                json.dump(died, f)
            with open(os.path.join(self.folder, f"die-in-step-{self.group}"), "w"):
                pass
            time.sleep(30)  # the manifest is never written: the training thread SIGKILLs the process at its next step
            os.kill(os.getpid(), signal.SIGKILL)  # (no next step: the fit's end save) never a hung run

        committer._upload = upload_or_die

    def eval_start(self, state, logger) -> None:
        self.eval_started = time.time()

    def eval_end(self, state, logger) -> None:
        """One ``evals-<pid>`` line per evaluation: the global batch, this group's eval metrics and seconds."""
        values = {k: float(v) for k, v in logger.metrics.items() if k.startswith("metrics/")}
        self._log(
            "evals", {"batch": int(state.timestamp.batch), "metrics": values, "s": time.time() - self.eval_started}
        )

    def _die_in_recovery(self, model) -> None:
        """Die while applying the state a healthy peer sent (the live recovery at a rejoin) when the test asks
        (``die-in-heal-<group>``): the model's ``load_state_dict`` is the recovery's first step (`ReplicaState`)."""
        load, flag = model.load_state_dict, os.path.join(self.folder, f"die-in-heal-{self.group}")

        def load_or_die(*args, **kwargs):
            if os.path.exists(flag):
                os.remove(flag)
                with open(os.path.join(self.folder, f"died-in-heal-{os.getpid()}"), "w"):
                    pass
                os.kill(os.getpid(), signal.SIGKILL)
            return load(*args, **kwargs)

        model.load_state_dict = load_or_die

    def on_quorum_change(self, state, logger, change) -> None:
        """The loop's hook (`Callback.on_quorum_change`): one record per change this group heard."""
        record = {
            "pid": os.getpid(),
            "group": self.group,
            "before": change.before,
            "after": change.after,
            "batch": change.batch,
            "state_batch": int(state.timestamp.batch),
            "t": time.time(),
        }
        with open(os.path.join(self.folder, f"quorum-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def after_train_batch(self, state, logger) -> None:
        """Die here, between backward and the step's all-reduce, when the test asks (``die-in-step-<group>``):
        the others' all-reduce fails and their step does not commit."""
        flag = os.path.join(self.folder, f"die-in-step-{self.group}")
        if os.path.exists(flag):
            os.remove(flag)
            os.kill(os.getpid(), signal.SIGKILL)

    def batch_end(self, state, logger) -> None:
        if self.first_step and self.checkpointer is not None:  # what this process read from storage, if anything
            self.first_step = False
            loaded = self.checkpointer.loaded
            self._log("loads", {"loaded": None if loaded is None else loaded.batch})
        held = self.commit.loader._held  # the global batch this step trained (or failed to)
        record = {
            "group": self.group,
            "pid": os.getpid(),
            "committed": self.commit.optimizer.committed,
            "epoch": int(state.timestamp.epoch),
            "batch_in_epoch": int(state.timestamp.batch_in_epoch),
            "batch": int(state.timestamp.batch),
            "participants": self.commit.loader.participants,
            "abandoned": self.commit.optimizer.watch.abandoned,  # all-reduces a failed peer ended (replica_abort.py)
            "ids": [int(i) for i in state.batch["id"].tolist()],
            "global": [int(i) for i in held[1]["id"].tolist()],
            "t": time.time(),
        }
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if not os.path.exists(os.path.join(self.folder, "done")):
            time.sleep(self.sleep_s)

    def fit_end(self, state, logger) -> None:
        self._record_saves(state)  # the final save
        self._record_manifests(wait=True)
        self.file.close()
        import torch

        final = {"model": self.commit.loader.replicas.model.state_dict(), "timestamp": state.timestamp.state_dict()}
        torch.save(final, os.path.join(self.folder, f"final-{os.getpid()}.pt"))


class RecordShards(RecordCommits):
    """`RecordCommits` for replica groups of ``group_size`` workers: ``group`` is the replica group, ``position`` the
    worker's place in it; at the end, this worker's parameter shards (local tensors) and how often it healed."""

    def __init__(self, folder: str, sleep_s: float, group_size: int) -> None:
        super().__init__(folder, sleep_s)
        self.group_size = group_size

    def fit_start(self, state, logger) -> None:
        import ray.train

        super().fit_start(state, logger)
        rank = ray.train.get_context().get_world_rank()
        self.group, self.position = rank // self.group_size, rank % self.group_size
        with open(os.path.join(self.folder, f"proc-{os.getpid()}.json"), "w") as f:
            json.dump({"pid": os.getpid(), "group": self.group, "position": self.position, "t": time.time()}, f)

    def fit_end(self, state, logger) -> None:
        self._record_saves(state)
        self.file.close()
        import torch

        replicas = self.commit.loader.replicas
        shards = {n: p.detach().to_local().clone() for n, p in replicas.model.named_parameters()}
        # the whole parameters (an all-gather over the group's mesh: every worker of a group ends here)
        full = {n: p.detach().full_tensor().clone() for n, p in replicas.model.named_parameters()}
        final = {
            "shards": shards,
            "full": full,
            "group": self.group,
            "position": self.position,
            "healed": replicas.healed,
            "loaded": None if self.checkpointer is None or self.checkpointer.loaded is None else "storage",
            "timestamp": state.timestamp.state_dict(),
        }
        torch.save(final, os.path.join(self.folder, f"final-{os.getpid()}.pt"))


def make_tensor_parallel_model():
    """`resume_helpers.make_model`'s classifier (the same initial weights) with a tensor-parallel plan: the first layer
    split by its outputs, the second by its inputs (Megatron's MLP)."""
    import torch

    from raytrain_events.models import ClassifierModel
    from tests.resume_helpers import DIM

    class Mlp(torch.nn.Sequential):
        def tensor_parallel_plan(self, degree: int) -> dict:
            return {"0": "colwise", "2": "rowwise"}

    torch.manual_seed(0)
    return ClassifierModel(Mlp(torch.nn.Linear(DIM, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)), num_classes=2)
