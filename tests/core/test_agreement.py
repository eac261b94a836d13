"""Agreement flags: asked on one rank, agreed by all at the same batch, through the loop's one collective."""

from __future__ import annotations

from typing import List, Sequence

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, Trainer
from raytrain_events.core.agreement import Agreement
from raytrain_events.models import ClassifierModel


def test_registration_is_idempotent_and_ordered_by_name():
    a, b = Agreement(), Agreement()
    for name in ("save", "report", "save"):
        a.register(name)
    for name in ("report", "save"):
        b.register(name)
    assert a.names == b.names == ("report", "save")


def test_requested_is_local_and_agreed_comes_from_the_sums():
    agreement = Agreement()
    agreement.register("report")
    agreement.register("save")
    agreement.request("save")
    assert agreement.requested("save") and not agreement.agreed("save")
    assert agreement.local_values() == [0, 1]
    agreement.set_sums([2, 0])  # two other ranks asked for a report; this rank's save is not summed yet
    assert agreement.agreed("report") and not agreement.agreed("save") and not agreement.requested("report")
    agreement.clear("report")
    assert not agreement.agreed("report") and agreement.local_values() == [0, 1]


def test_reading_an_unknown_flag_names_the_fix_and_a_known_one_reads_its_agreement():
    """`Agreement.agreed` (read every batch) looks its flag up once; an unregistered name still raises the fix."""
    agreement = Agreement()
    with pytest.raises(KeyError, match=r"register\('spike'\)"):
        agreement.agreed("spike")
    agreement.register("spike")
    assert agreement.agreed("spike") is False
    agreement.set_sums([1])
    assert agreement.agreed("spike") is True


def test_unknown_flag_names_the_fix():
    agreement = Agreement()
    with pytest.raises(KeyError, match=r"register\('save'\)"):
        agreement.request("save")
    agreement.register("save")
    with pytest.raises(ValueError, match="2 flag sums for 1"):
        agreement.set_sums([0, 1])


class _AskAt(Callback):
    """Registers a new flag (no change to State or the loop) and asks for it on chosen batches."""

    def __init__(self, ask_at: Sequence[int]) -> None:
        self.ask_at = set(ask_at)
        self.agreed_at: List[int] = []

    def init(self, state, logger):
        state.agreement.register("custom")

    def after_dataloader(self, state, logger):
        if state.step + 1 in self.ask_at:
            state.request("custom")

    def batch_end(self, state, logger):
        if state.agreed("custom"):
            self.agreed_at.append(state.step)
            state.agreement.clear("custom")


def test_a_new_flag_is_agreed_at_the_batch_it_was_asked_without_a_counter_sum_in_one_process():
    """One process: the batch's values are the sums, so the loop starts no counter sum, and a flag asked
    during a batch is agreed at that batch's end, as the ranks' sum would agree it (the distributed
    path: tests/ray/reports/test_report_preemption.py::test_time_based_reports_are_agreed_through_the_batch_collective)."""
    torch.manual_seed(0)
    model = ClassifierModel(torch.nn.Linear(4, 2), num_classes=2)
    data = TensorDataset(torch.randn(40, 4), torch.randint(0, 2, (40,)))
    asker = _AskAt([2, 5])
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(data, batch_size=8),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[asker],
    )
    sent: List[List[int]] = []
    start = trainer._counters.start
    trainer._counters.start = lambda values: (sent.append(list(values)), start(values))[1]  # type: ignore[method-assign]
    trainer.fit()
    assert asker.agreed_at == [2, 5]
    assert sent == []  # no counter calls at all in one process


def test_counts_ride_on_the_same_sum_as_the_flags():
    agreement = Agreement()
    agreement.register("save")
    agreement.register_count("mixture/samples/web")
    agreement.register_count("mixture/samples/web")  # idempotent
    assert agreement.names == ("mixture/samples/web", "save")
    agreement.set_count("mixture/samples/web", 7)
    agreement.request("save")
    assert agreement.local_values() == [7, 1]
    agreement.set_sums([21, 2])  # what the loop's per-batch sum over three ranks gives back
    assert agreement.total("mixture/samples/web") == 21 and agreement.agreed("save")
    with pytest.raises(KeyError, match=r"register_count\('other'\)"):
        agreement.set_count("other", 1)


def test_all_zero_sums_after_all_zero_sums_change_nothing_and_any_other_sums_are_read():
    """`set_sums` returns at once on all-zero sums after all-zero sums (most batches: nothing to agree, clear or
    count); every other case is read in full: a flag agreed then all zeros is no longer agreed, counts go back to
    0, the same non-zero sums again agree again after the owner cleared the flag."""
    agreement = Agreement()
    agreement.register("save")
    agreement.register_count("rows")
    agreement.set_sums([0, 0])
    agreement.set_sums([0, 0])  # the quick return
    assert not agreement.agreed("save") and agreement.total("rows") == 0
    agreement.set_sums([5, 1])
    assert agreement.agreed("save") and agreement.total("rows") == 5
    agreement.clear("save")
    agreement.set_sums([5, 1])  # the same sums: agreed again (asked again somewhere)
    assert agreement.agreed("save")
    agreement.set_sums([0, 0])  # read in full: the sums before were not all zero
    assert not agreement.agreed("save") and agreement.total("rows") == 0
    agreement.set_sums([0, 0])
    agreement.register("stop")  # a flag registered later starts not agreed; the quick return keeps it so
    agreement.set_sums([0, 0, 0])
    assert agreement.names == ("rows", "save", "stop") and not any(agreement.agreed(n) for n in ("save", "stop"))
    agreement.set_sums([0, 0, 3])
    assert agreement.agreed("stop") and not agreement.agreed("save")


def test_one_process_sums_are_none_while_nothing_would_change_and_else_a_copy_of_the_requests():
    """The one-process loop reads `one_process_sums` before the batch and hands it to `set_sums` after: None (no
    copy, no call) while every value is 0 after all-zero sums; else a copy (a hook asking during the batch is read at
    the next one), and after a flag was agreed, zeros again (read: the flag is no longer agreed)."""
    agreement = Agreement()
    assert agreement.one_process_sums() is None  # nothing registered
    agreement.register("spike")
    assert agreement.one_process_sums() is None
    agreement.request("spike")
    sums = agreement.one_process_sums()
    assert sums == [1] and sums is not agreement.local_values()
    agreement.set_sums(sums)
    assert agreement.agreed("spike")
    agreement.clear("spike")
    sums = agreement.one_process_sums()
    assert sums == [0]  # not None: the sums before were not all zero
    agreement.set_sums(sums)
    assert not agreement.agreed("spike") and agreement.one_process_sums() is None
