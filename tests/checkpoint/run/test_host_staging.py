"""The device-to-host copy of async saves goes into host buffers reused by later saves (issue 28 item 3).

CPU: the same buffer storage across two saves, the values right, no aliasing (training after the
copy does not change the saved values), a leased buffer set never overwritten, shape changes
get a new buffer. The pinned (CUDA) path is checked with a small mock: no GPU here.
"""

from __future__ import annotations

import torch

from raytrain_events.checkpoint.run import staging
from raytrain_events.checkpoint.run.staging import HostStager


def _state(scale: float) -> dict:
    return {
        "model": {"w": torch.full((4, 3), scale), "b": torch.arange(3.0) * scale},
        "optim": [{"step": torch.tensor(scale), "lr": 0.1 * scale}],
        "name": "run",
    }


def _ptrs(tree) -> list:
    return [tree["model"]["w"].data_ptr(), tree["model"]["b"].data_ptr(), tree["optim"][0]["step"].data_ptr()]


def test_two_saves_reuse_the_same_buffers_with_the_right_values():
    stager, src = HostStager(), _state(1.0)
    first = stager.stage(src)
    assert (first.allocated, first.reused) == (3, 0)
    ptrs = _ptrs(first.tree)
    saved_w = first.tree["model"]["w"].clone()
    first.release()
    src["model"]["w"].add_(5.0)  # training goes on
    src["optim"][0]["lr"] = 0.7
    second = stager.stage(src)
    assert (second.allocated, second.reused) == (0, 3)
    assert _ptrs(second.tree) == ptrs  # the same storage, not a new allocation
    torch.testing.assert_close(second.tree["model"]["w"], saved_w + 5.0, rtol=0, atol=0)
    assert second.tree["optim"][0]["lr"] == 0.7 and second.tree["name"] == "run"


def test_training_after_the_copy_does_not_change_the_saved_values():
    stager, src = HostStager(), _state(2.0)
    staged = stager.stage(src)
    for p in (src["model"]["w"], src["model"]["b"], src["optim"][0]["step"]):
        assert p.data_ptr() not in _ptrs(staged.tree)
    src["model"]["w"].mul_(-3.0)
    src["model"]["b"].zero_()
    src["optim"][0]["step"].add_(1)
    torch.testing.assert_close(staged.tree["model"]["w"], torch.full((4, 3), 2.0), rtol=0, atol=0)
    torch.testing.assert_close(staged.tree["model"]["b"], torch.arange(3.0) * 2.0, rtol=0, atol=0)
    assert staged.tree["optim"][0]["step"].item() == 2.0


def test_a_save_staged_while_the_buffers_are_uploading_gets_fresh_buffers():
    stager = HostStager()
    uploading = stager.stage(_state(1.0))  # not released: its upload is still running
    meanwhile = stager.stage(_state(9.0))
    assert not set(_ptrs(meanwhile.tree)) & set(_ptrs(uploading.tree))
    assert uploading.tree["model"]["w"][0, 0].item() == 1.0  # not overwritten
    meanwhile.release()  # a one-off set: releasing it frees nothing that is leased
    uploading.release()
    uploading.release()  # idempotent
    again = stager.stage(_state(3.0))
    assert _ptrs(again.tree) == _ptrs(uploading.tree) and again.reused == 3


def test_a_tensor_that_changed_shape_or_dtype_gets_a_new_buffer_and_the_old_one_is_dropped():
    stager = HostStager()
    stager.stage({"w": torch.ones(4), "v": torch.ones(2)}).release()
    staged = stager.stage({"w": torch.ones(5), "v": torch.ones(2, dtype=torch.float64)})
    assert (staged.allocated, staged.reused) == (2, 0)
    staged.release()
    assert len(stager._buffers) == 2  # the 4-element and float32 buffers are gone


def test_a_failed_copy_releases_the_lease():
    stager = HostStager()

    class Boom(dict):
        def items(self):
            raise RuntimeError("boom")

    try:
        stager.stage(Boom(a=1))
    except RuntimeError:
        pass
    assert stager.stage(_state(1.0)).allocated == 3 and stager._leased


def test_cuda_sources_get_pinned_buffers_and_one_synchronize(monkeypatch):
    """The pinned path, mocked: a 'CUDA' source allocates pinned host memory once, copies without
    blocking, and one ``torch.cuda.synchronize`` ends the save's copies; the next save reuses it."""
    pins, syncs, copies = [], [], []
    real_empty = staging._empty
    monkeypatch.setattr(staging, "_on_accelerator", lambda t: True)
    monkeypatch.setattr(staging, "_empty", lambda t, pin: (pins.append(pin), real_empty(t, False))[1])
    monkeypatch.setattr(staging, "_synchronize", lambda: syncs.append(1))
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(
        torch.Tensor,
        "copy_",
        lambda self, src, non_blocking=False: (copies.append(non_blocking), real_copy(self, src))[1],
    )
    stager = HostStager()
    stager.stage(_state(1.0)).release()
    second = stager.stage(_state(4.0))
    monkeypatch.undo()
    assert pins == [True, True, True]  # allocated (pinned) once, at the first save
    assert syncs == [1, 1] and copies == [True] * 6
    assert second.tree["model"]["w"][0, 0].item() == 4.0


def test_without_cuda_sources_nothing_is_pinned_or_synchronized(monkeypatch):
    monkeypatch.setattr(staging, "_synchronize", lambda: (_ for _ in ()).throw(AssertionError("no sync on CPU")))
    staged = HostStager().stage(_state(1.0))
    assert not staged.tree["model"]["w"].is_pinned()
