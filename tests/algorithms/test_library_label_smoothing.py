"""LabelSmoothing: the loss is cross-entropy against smoothed targets; labels come back after the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from library_helpers import Record, loader, trainer

from raytrain_events import Event
from raytrain_events.algorithms import LabelSmoothing, smooth_labels


def test_loss_equals_closed_form_and_targets_are_restored():
    s, num_classes = 0.2, 3
    rec = Record(
        {
            Event.AFTER_FORWARD: lambda st: st.outputs.detach().clone(),
            Event.BEFORE_LOSS: lambda st: st.batch[1].clone(),
            Event.AFTER_LOSS: lambda st: (st.loss.detach().clone(), st.batch[1].clone()),
            Event.AFTER_DATALOADER: lambda st: st.batch[1].clone(),
        }
    )
    trainer(algorithms=[LabelSmoothing(smoothing=s)], callbacks=[rec], max_duration="2ba").fit()
    for outputs, soft, (loss, after), labels in zip(
        rec.values[Event.AFTER_FORWARD],
        rec.values[Event.BEFORE_LOSS],
        rec.values[Event.AFTER_LOSS],
        rec.values[Event.AFTER_DATALOADER],
    ):
        expected_targets = F.one_hot(labels, num_classes).float() * (1 - s) + s / num_classes
        torch.testing.assert_close(soft, expected_targets)
        log_p = outputs.log_softmax(-1)
        # closed form: (1 - s) * CE(hard) + s * mean over classes of -log p
        closed = ((1 - s) * -log_p.gather(1, labels[:, None]).squeeze(1) + s * -log_p.mean(-1)).mean()
        torch.testing.assert_close(loss, closed)
        assert after.dtype == torch.int64 and torch.equal(after, labels)  # restored for metrics


def test_soft_targets_are_smoothed_as_probabilities():
    logits = torch.zeros(2, 4)
    probs = torch.tensor([[0.7, 0.3, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5]])
    out = smooth_labels(logits, probs, 0.4)
    torch.testing.assert_close(out, probs * 0.6 + 0.1)
    torch.testing.assert_close(out.sum(-1), torch.ones(2))


def test_dict_batches_and_grad_accum():
    class DictLoader:
        def __init__(self, base):
            self.base = base

        def __iter__(self):
            return ({"x": x, "y": y} for x, y in self.base)

        def __len__(self):
            return len(self.base)

    rec = Record({Event.BEFORE_LOSS: lambda st: st.batch["y"].shape, Event.AFTER_LOSS: lambda st: st.batch["y"].dtype})
    trainer(
        train_dataloader=DictLoader(loader()),
        algorithms=[LabelSmoothing(0.1)],
        callbacks=[rec],
        max_duration="1ba",
        grad_accum=2,
    ).fit()
    assert rec.values[Event.BEFORE_LOSS] == [torch.Size([4, 3])] * 2  # per microbatch
    assert rec.values[Event.AFTER_LOSS] == [torch.int64] * 2


def test_bad_smoothing():
    with pytest.raises(ValueError, match="smoothing"):
        LabelSmoothing(smoothing=1.0)
