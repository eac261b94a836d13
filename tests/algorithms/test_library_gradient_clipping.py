"""GradientClipping: the gradients the optimizer steps with are clipped exactly as specified."""

from __future__ import annotations

import pytest
import torch
from library_helpers import Record, RecordAlgorithm, classifier, trainer

from raytrain_events import Event
from raytrain_events.algorithms import GradientClipping


def _grads(state):
    return [p.grad.detach().clone() for p in state.model.parameters()]


def _run(clipping):
    # Listed after GradientClipping, the recorder runs *before* it on AFTER_TRAIN_BATCH (reverse
    # order), so it sees the raw gradients; the callback runs after every algorithm.
    before = RecordAlgorithm({Event.AFTER_TRAIN_BATCH: _grads})
    after = Record({Event.AFTER_TRAIN_BATCH: _grads})
    model = classifier(hidden=8)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(20.0)  # large weights -> large gradients
    trainer(model, algorithms=[clipping, before], callbacks=[after], max_duration="3ba").fit()
    return before.values[Event.AFTER_TRAIN_BATCH], after.values[Event.AFTER_TRAIN_BATCH]


def test_norm_clipping_scales_gradients_to_the_threshold():
    raw, clipped = _run(GradientClipping(clipping_type="norm", clipping_threshold=0.5))
    assert len(raw) == len(clipped) == 3
    for g_raw, g_clip in zip(raw, clipped):
        raw_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in g_raw]))
        clip_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in g_clip]))
        assert raw_norm > 0.5  # clipping had something to do
        assert clip_norm <= 0.5 + 1e-5
        scale = min(1.0, 0.5 / (float(raw_norm) + 1e-6))
        for a, b in zip(g_raw, g_clip):
            torch.testing.assert_close(b, a * scale, rtol=1e-4, atol=1e-6)


def test_value_clipping_clamps_each_element():
    raw, clipped = _run(GradientClipping(clipping_type="value", clipping_threshold=0.05))
    assert any(float(g.abs().max()) > 0.05 for gs in raw for g in gs)
    for g_raw, g_clip in zip(raw, clipped):
        for a, b in zip(g_raw, g_clip):
            torch.testing.assert_close(b, a.clamp(-0.05, 0.05))


def test_bad_arguments():
    with pytest.raises(ValueError, match="norm"):
        GradientClipping(clipping_type="adaptive-ish", clipping_threshold=1.0)
    with pytest.raises(ValueError, match="> 0"):
        GradientClipping(clipping_threshold=0.0)
