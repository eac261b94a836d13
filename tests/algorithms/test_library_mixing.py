"""MixUp and CutMix: mixed inputs, mixed soft targets, restoration, and composition with LabelSmoothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from library_helpers import Record, image_classifier, loader, trainer

from raytrain_events import Event
from raytrain_events.algorithms import CutMix, LabelSmoothing, MixUp
from raytrain_events.algorithms.cutmix import random_box

C = 3


def _mixing_record(algo):
    return Record(
        {
            Event.AFTER_DATALOADER: lambda s: (s.batch[0].clone(), s.batch[1].clone()),
            Event.BEFORE_FORWARD: lambda s: (s.batch[0].clone(), algo.mixing_coef, algo.permutation.clone()),
            Event.BEFORE_LOSS: lambda s: s.batch[1].clone(),
            Event.AFTER_LOSS: lambda s: (s.loss.detach().clone(), s.batch[1].clone()),
            Event.AFTER_FORWARD: lambda s: s.outputs.detach().clone(),
        }
    )


def test_mixup_mixes_inputs_and_targets_then_restores_labels():
    algo = MixUp(alpha=0.4)
    rec = _mixing_record(algo)
    trainer(algorithms=[algo], callbacks=[rec], max_duration="3ba").fit()
    lams = []
    for (x, y), (mixed, lam, perm), soft, (loss, restored), out in zip(
        *(
            rec.values[e]
            for e in (
                Event.AFTER_DATALOADER,
                Event.BEFORE_FORWARD,
                Event.BEFORE_LOSS,
                Event.AFTER_LOSS,
                Event.AFTER_FORWARD,
            )
        )
    ):
        lams.append(lam)
        assert 0.0 <= lam <= 1.0 and sorted(perm.tolist()) == list(range(len(x)))
        torch.testing.assert_close(mixed, lam * x + (1 - lam) * x[perm])
        onehot = F.one_hot(y, C).float()
        torch.testing.assert_close(soft, lam * onehot + (1 - lam) * onehot[perm])
        torch.testing.assert_close(loss, F.cross_entropy(out, lam * onehot + (1 - lam) * onehot[perm]))
        assert torch.equal(restored, y)
    assert len(set(lams)) == 3  # a fresh lambda every batch


def test_mixup_interpolate_loss():
    algo = MixUp(alpha=0.4, interpolate_loss=True)
    rec = _mixing_record(algo)
    trainer(algorithms=[algo], callbacks=[rec], max_duration="2ba").fit()
    for (_x, y), (_, lam, perm), targets, (loss, _), out in zip(
        *(
            rec.values[e]
            for e in (
                Event.AFTER_DATALOADER,
                Event.BEFORE_FORWARD,
                Event.BEFORE_LOSS,
                Event.AFTER_LOSS,
                Event.AFTER_FORWARD,
            )
        )
    ):
        assert torch.equal(targets, y)  # targets untouched
        torch.testing.assert_close(loss, lam * F.cross_entropy(out, y) + (1 - lam) * F.cross_entropy(out, y[perm]))


def test_mixup_permutes_within_each_microbatch():
    algo = MixUp(alpha=1.0)
    rec = Record({Event.BEFORE_FORWARD: lambda s: algo.permutation.clone()})
    trainer(algorithms=[algo], callbacks=[rec], max_duration="1ba", grad_accum=2).fit()
    assert [sorted(p.tolist()) for p in rec.values[Event.BEFORE_FORWARD]] == [[0, 1, 2, 3]] * 2


@pytest.mark.parametrize("order", ["mixup_first", "smoothing_first"])
def test_mixup_with_label_smoothing_gives_smoothed_mixed_targets(order):
    s = 0.3
    mix, smooth = MixUp(alpha=0.5), LabelSmoothing(s)
    algos = [mix, smooth] if order == "mixup_first" else [smooth, mix]
    rec = _mixing_record(mix)
    trainer(algorithms=algos, callbacks=[rec], max_duration="2ba").fit()
    for (_x, y), (_, lam, perm), soft, (loss, restored), out in zip(
        *(
            rec.values[e]
            for e in (
                Event.AFTER_DATALOADER,
                Event.BEFORE_FORWARD,
                Event.BEFORE_LOSS,
                Event.AFTER_LOSS,
                Event.AFTER_FORWARD,
            )
        )
    ):
        onehot = F.one_hot(y, C).float()
        expected = (1 - s) * (lam * onehot + (1 - lam) * onehot[perm]) + s / C
        torch.testing.assert_close(soft, expected)
        torch.testing.assert_close(soft.sum(-1), torch.ones(len(y)))
        torch.testing.assert_close(loss, F.cross_entropy(out, expected))
        assert restored.dtype == torch.int64 and torch.equal(restored, y)


def test_cutmix_pastes_a_box_and_weights_targets_by_area():
    algo = CutMix(alpha=1.0)
    rec = _mixing_record(algo)
    boxes = Record({Event.BEFORE_FORWARD: lambda s: algo.bbox})
    trainer(
        image_classifier(),
        train_dataloader=loader(n=64, batch_size=8, shape=(3, 8, 8)),
        algorithms=[algo],
        callbacks=[rec, boxes],
        max_duration="6ba",
    ).fit()
    areas = []
    for (x, y), (mixed, lam, perm), soft, (_, restored), box in zip(
        *(
            rec.values[e]
            for e in (
                Event.AFTER_DATALOADER,
                Event.BEFORE_FORWARD,
                Event.BEFORE_LOSS,
                Event.AFTER_LOSS,
            )
        ),
        boxes.values[Event.BEFORE_FORWARD],
    ):
        top, bottom, left, right = box
        inside = torch.zeros(8, 8, dtype=torch.bool)
        inside[top:bottom, left:right] = True
        area = int(inside.sum())
        areas.append(area)
        expected = torch.where(inside, x[perm], x)
        assert torch.equal(mixed, expected)
        assert lam == pytest.approx(1 - area / 64)
        onehot = F.one_hot(y, C).float()
        torch.testing.assert_close(soft, lam * onehot + (1 - lam) * onehot[perm])
        assert torch.equal(restored, y)
    assert max(areas) > 0  # some batches really pasted a box


@settings(max_examples=60, deadline=None)
@given(h=st.integers(1, 40), w=st.integers(1, 40), lam=st.floats(0.0, 1.0))
def test_random_box_stays_inside_and_is_at_most_the_requested_area(h, w, lam):
    top, bottom, left, right = random_box(h, w, lam)
    assert 0 <= top <= bottom <= h and 0 <= left <= right <= w
    assert (bottom - top) * (right - left) <= (1 - lam) * h * w + 1e-9


def test_cutmix_needs_images():
    with pytest.raises(ValueError, match=r"\(N, C, H, W\)"):
        trainer(algorithms=[CutMix()], max_duration="1ba").fit()
