"""ChannelsLast, ProgressiveResizing and SeqLengthWarmup: what the model actually receives."""

from __future__ import annotations

import pytest
import torch
from library_helpers import Record, TinyLM, image_classifier, loader, token_batches, trainer

from raytrain_events import DataSpec, Event
from raytrain_events.algorithms import ChannelsLast, ProgressiveResizing, SeqLengthWarmup
from raytrain_events.algorithms.progressive_resizing import resize_scale
from raytrain_events.algorithms.seq_length_warmup import warmup_seq_length


# ----------------------------------------------------------------------------------- ChannelsLast
def test_channels_last_converts_conv_weights_in_place():
    model = image_classifier()
    conv = model.module[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = conv.weight
    assert not conv.weight.is_contiguous(memory_format=torch.channels_last)
    t = trainer(
        model, optimizer=opt, train_dataloader=loader(shape=(3, 6, 6)), max_duration="1ba", algorithms=[ChannelsLast()]
    )
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)
    assert conv.weight is weight and opt.param_groups[0]["params"][0] is weight  # same Parameter object
    before = weight.detach().clone()
    t.fit()
    assert not torch.equal(before, conv.weight.detach())  # the optimizer still updates it
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


# ---------------------------------------------------------------------------- ProgressiveResizing
def test_progressive_resizing_follows_the_schedule():
    rec = Record({Event.BEFORE_FORWARD: lambda s: tuple(s.batch[0].shape[-2:])})
    trainer(
        image_classifier(),
        train_dataloader=loader(n=80, batch_size=8, shape=(3, 16, 16)),
        max_duration="10ba",
        algorithms=[
            ProgressiveResizing(initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2, size_increment=4)
        ],
        callbacks=[rec],
    ).fit()
    # scale 0.5 until 50%, linear to 1.0 at 80%: k=6 -> 0.667 (10.7px -> 8), k=7 -> 0.833 (13.3 -> 12)
    sides = [h for h, w in rec.values[Event.BEFORE_FORWARD]]
    assert sides == [8, 8, 8, 8, 8, 8, 8, 12, 16, 16]
    assert all(h == w for h, w in rec.values[Event.BEFORE_FORWARD])


def test_progressive_resizing_crop_takes_a_window():
    algo = ProgressiveResizing(mode="crop", initial_scale=0.5, delay_fraction=1.0, finetune_fraction=0.0)
    rec = Record({Event.AFTER_DATALOADER: lambda s: s.batch[0].clone()})
    data = loader(n=8, batch_size=8, shape=(1, 8, 8))
    trainer(
        image_classifier(channels=1), train_dataloader=data, max_duration="1ba", algorithms=[algo], callbacks=[rec]
    ).fit()
    (crop,) = rec.values[Event.AFTER_DATALOADER]
    full = next(iter(data))[0]
    assert crop.shape[-2:] == (4, 4)
    windows = full.unfold(2, 4, 1).unfold(3, 4, 1)  # every 4x4 window
    assert any(torch.equal(windows[:, :, i, j], crop) for i in range(5) for j in range(5))


def test_resize_scale_bounds():
    assert resize_scale(0.0, 0.5, 0.5, 0.2) == 0.5
    assert resize_scale(0.65, 0.5, 0.5, 0.2) == pytest.approx(0.75)
    assert resize_scale(0.9, 0.5, 0.5, 0.2) == 1.0


# ------------------------------------------------------------------------------- SeqLengthWarmup
def _lengths_rec():
    return Record(
        {
            Event.BEFORE_FORWARD: lambda s: (
                s.timestamp.get_value("tok"),
                s.timestamp.get_value("ba"),
                tuple(s.batch["input_ids"].shape),
                tuple(s.batch["labels"].shape),
                tuple(s.batch["attention_mask"].shape),
            )
        }
    )


def test_seq_length_warmup_in_batches():
    rec = _lengths_rec()
    model = TinyLM()
    trainer(
        model,
        train_dataloader=token_batches(10),
        max_duration="10ba",
        algorithms=[SeqLengthWarmup(duration="0.5dur", min_seq_length=8, max_seq_length=64, step_size=8)],
        callbacks=[rec],
    ).fit()
    got = [ids[1] for _, _, ids, labels, mask in rec.values[Event.BEFORE_FORWARD]]
    want = [warmup_seq_length(k / 10 / 0.5, 8, 64, 8) for k in range(10)]
    assert want == [8, 16, 24, 40, 48, 64, 64, 64, 64, 64]
    assert got == want
    assert all(ids == labels == mask for _, _, ids, labels, mask in rec.values[Event.BEFORE_FORWARD])


def test_seq_length_warmup_with_max_duration_in_tokens():
    rec = _lengths_rec()
    spec = DataSpec(token_batches(20), get_num_tokens_in_batch=lambda b: int(b["attention_mask"].sum()))
    t = trainer(
        TinyLM(),
        train_dataloader=spec,
        max_duration="1200tok",
        algorithms=[SeqLengthWarmup(duration="0.5dur", min_seq_length=8, max_seq_length=64, step_size=8)],
        callbacks=[rec],
    )
    t.fit()
    rows = rec.values[Event.BEFORE_FORWARD]
    previous = 0
    for tokens, _, (_n, length), _, _ in rows:
        assert length == warmup_seq_length(tokens / 1200 / 0.5, 8, 64, 8)  # from the elapsed token fraction
        assert tokens >= previous
        previous = tokens
    # the token counter saw the truncated batches: tokens advance by N * length per batch
    steps = [b[0] for b in rows] + [t.state.timestamp.get_value("tok")]
    assert [b - a for a, b in zip(steps, steps[1:])] == [n * length for _, _, (n, length), _, _ in rows]
    assert rows[0][2][1] == 8 and rows[-1][2][1] == 64
    assert t.state.timestamp.get_value("tok") >= 1200 > rows[-1][0]


def test_seq_length_warmup_reshape_keeps_tokens():
    rec = Record({Event.BEFORE_FORWARD: lambda s: s.batch["input_ids"].clone()})
    batches = token_batches(1, batch_size=2, seq_len=64)
    trainer(
        TinyLM(),
        train_dataloader=batches,
        max_duration="1ba",
        algorithms=[SeqLengthWarmup(duration="1dur", min_seq_length=16, step_size=8, truncate=False)],
        callbacks=[rec],
    ).fit()
    (ids,) = rec.values[Event.BEFORE_FORWARD]
    assert ids.shape == (8, 16)
    assert torch.equal(ids.flatten(), batches[0]["input_ids"].flatten())


def test_seq_length_warmup_errors():
    with pytest.raises(TypeError, match="dict batches"):
        trainer(algorithms=[SeqLengthWarmup()], max_duration="1ba").fit()
    with pytest.raises(ValueError, match="max_seq_length"):
        SeqLengthWarmup(min_seq_length=32, max_seq_length=16)
