"""What the Trainer computes: gradient accumulation, mixed precision, learning, no host reads."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from raytrain_events import Callback, DataSpec, Precision, Trainer
from raytrain_events.models import ClassifierModel


def mlp(d_in=6, hidden=16, classes=3, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, classes))


# ---------------------------------------------------------------------------------------------------------------
# gradient accumulation
# ---------------------------------------------------------------------------------------------------------------
def _accum_run(grad_accum, *, as_dict, batch_size, n=40, steps="2ep"):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (n,), generator=g)
    if as_dict:
        loader = [{"x": x[i : i + batch_size], "y": y[i : i + batch_size]} for i in range(0, n, batch_size)]
    else:
        loader = DataLoader(TensorDataset(x, y), batch_size=batch_size)
    model = ClassifierModel(mlp().double(), num_classes=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-3)
    state = Trainer(
        model=model, train_dataloader=loader, max_duration=steps, optimizers=opt, grad_accum=grad_accum
    ).fit()
    return [p.detach().clone() for p in model.parameters()], state


@pytest.mark.parametrize("as_dict", [False, True], ids=["pair", "dict"])
@pytest.mark.parametrize("grad_accum, batch_size", [(4, 8), (2, 8), (4, 10), (3, 10)])
def test_grad_accum_matches_full_batch(grad_accum, batch_size, as_dict):
    """Microbatches weighted by their sample count give the full-batch gradient, even when uneven."""
    reference, ref_state = _accum_run(1, as_dict=as_dict, batch_size=batch_size)
    params, state = _accum_run(grad_accum, as_dict=as_dict, batch_size=batch_size)
    start = [p.detach() for p in ClassifierModel(mlp().double(), num_classes=3).parameters()]
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(reference, start))  # training did move them
    for a, b in zip(params, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert state.step == ref_state.step
    # the logged loss is the full-batch mean either way
    assert abs(float(state.loss) - float(ref_state.loss)) < 1e-9


def test_microbatches_seen_by_events():
    shapes = []

    class Shapes(Callback):
        def before_forward(self, state, logger):
            shapes.append(tuple(state.batch[0].shape))

        def after_train_batch(self, state, logger):
            shapes.append(("full", tuple(state.batch[0].shape)))

    x, y = torch.randn(10, 6), torch.randint(0, 3, (10,))
    model = ClassifierModel(mlp(), num_classes=3)
    Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, y), batch_size=10),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        grad_accum=4,
        callbacks=[Shapes()],
    ).fit()
    assert shapes == [(3, 6), (3, 6), (2, 6), (2, 6), ("full", (10, 6))]


# ---------------------------------------------------------------------------------------------------------------
# precision
# ---------------------------------------------------------------------------------------------------------------
class Dtypes(Callback):
    def __init__(self):
        self.outputs, self.losses = [], []

    def after_forward(self, state, logger):
        self.outputs.append(state.outputs.dtype)

    def batch_end(self, state, logger):
        self.losses.append(float(state.loss))


def _precision_run(precision):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    model = ClassifierModel(mlp(), num_classes=3)
    before = [p.detach().clone() for p in model.parameters()]
    cb = Dtypes()
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, y), batch_size=16),
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        precision=precision,
        callbacks=[cb],
    )
    state = trainer.fit()
    changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return state, cb, changed


def test_amp_bf16_on_cpu():
    state, cb, changed = _precision_run("amp_bf16")
    assert state.precision is Precision.AMP_BF16 and state.scaler is None
    assert set(cb.outputs) == {torch.bfloat16}  # autocast was really on
    assert all(math.isfinite(v) for v in cb.losses) and len(cb.losses) == 8
    assert changed
    assert all(p.dtype == torch.float32 for p in state.model.parameters())  # master weights stay fp32


def test_amp_fp16_on_cpu_uses_a_grad_scaler():
    # torch 2.13 supports fp16 autocast and GradScaler("cpu") on CPU, so the Trainer runs it.
    state, cb, changed = _precision_run("amp_fp16")
    assert state.precision is Precision.AMP_FP16
    assert isinstance(state.scaler, torch.amp.GradScaler) and state.scaler._device == "cpu"
    assert set(cb.outputs) == {torch.float16}
    assert all(math.isfinite(v) for v in cb.losses)
    assert changed
    assert state.scaler.get_scale() > 0
    assert "scaler" in state.state_dict() and state.state_dict()["scaler"]


def test_fp32_is_default():
    state, cb, _ = _precision_run("fp32")
    assert set(cb.outputs) == {torch.float32} and state.scaler is None


# ---------------------------------------------------------------------------------------------------------------
# a real model learns
# ---------------------------------------------------------------------------------------------------------------
def blobs(n, classes=10, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(123)) * 3
    y = torch.randint(0, classes, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, dim, generator=g), y)


def test_small_model_learns_ten_classes():
    losses = []

    class Losses(Callback):
        def batch_end(self, state, logger):
            losses.append(float(state.loss))

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    model = ClassifierModel(net, num_classes=10)
    train = DataLoader(blobs(1024), batch_size=64, shuffle=True, generator=torch.Generator().manual_seed(0))
    evals = DataLoader(blobs(512, seed=1), batch_size=256)
    trainer = Trainer(
        model=model,
        train_dataloader=train,
        eval_dataloader=evals,
        max_duration="3ep",
        optimizers=torch.optim.Adam(model.parameters(), lr=1e-2),
        callbacks=[Losses()],
        seed=0,
    )
    trainer.fit()
    assert len(losses) == 48
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 1.5 and last < 0.5 * first, (first, last)
    accuracy = float(trainer.logger.metrics["metrics/eval/accuracy"])
    assert accuracy > 0.9, accuracy  # chance is 0.1
    assert float(trainer.logger.metrics["metrics/eval/cross_entropy"]) < 0.5


# ---------------------------------------------------------------------------------------------------------------
# nothing is read back from the device per step
# ---------------------------------------------------------------------------------------------------------------
READBACKS = ["item", "tolist", "__bool__", "__float__", "__int__", "__index__"]


def _count_readbacks(monkeypatch):
    calls = {name: 0 for name in READBACKS}
    for name in READBACKS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return calls


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_no_host_reads_per_step(monkeypatch, grad_accum):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 6, generator=g), torch.randint(0, 3, (64,), generator=g)
    # A list of batches, not a DataLoader: each DataLoader iterator draws its base seed with .item().
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    model = ClassifierModel(mlp(), num_classes=3)
    trainer = Trainer(
        model=model,
        train_dataloader=batches,
        max_duration="2ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        grad_accum=grad_accum,
    )

    # Control: the counter does see reads (so a zero below means something).
    calls = _count_readbacks(monkeypatch)
    torch.ones(1).item()
    assert calls["item"] == 1
    calls["item"] = 0

    state = trainer.fit()
    assert calls == {name: 0 for name in READBACKS}
    assert isinstance(state.loss, torch.Tensor) and not state.loss.requires_grad and state.loss.grad_fn is None
    assert state.loss.dim() == 0 and state.step == 8


def test_state_loss_is_detached_at_every_batch_end():
    seen = []

    class Check(Callback):
        def after_loss(self, state, logger):
            seen.append(("after_loss", state.loss.requires_grad))

        def batch_end(self, state, logger):
            seen.append(("batch_end", state.loss.requires_grad))

    model = ClassifierModel(mlp(), num_classes=3)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, y), batch_size=8),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        callbacks=[Check()],
    ).fit()
    # algorithms may change the loss at AFTER_LOSS (so it still has its graph); afterwards it is detached
    assert seen == [("after_loss", True), ("batch_end", False)] * 2


def test_dict_loss_is_summed():
    class TwoLosses(ClassifierModel):
        def loss(self, outputs, batch):
            ce = super().loss(outputs, batch)
            return {"ce": ce, "l2": 0.0 * outputs.pow(2).mean()}

    model = TwoLosses(mlp(), num_classes=3)
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    state = Trainer(
        model=model,
        train_dataloader=DataLoader(TensorDataset(x, y), batch_size=8),
        max_duration="1ep",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
    ).fit()
    assert isinstance(state.loss, torch.Tensor) and math.isfinite(float(state.loss))


def test_seed_makes_runs_repeatable():
    def once():
        model = ClassifierModel(mlp(seed=3), num_classes=3)
        x, y = torch.randn(32, 6, generator=torch.Generator().manual_seed(0)), torch.arange(32) % 3
        loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
        Trainer(
            model=model,
            train_dataloader=loader,
            max_duration="2ep",
            seed=7,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        ).fit()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(once(), once()):
        assert torch.equal(a, b)


def test_no_token_counter_means_zero_tokens():
    # A DataSpec with no token counter never calls one; the sample count comes from .shape (no read).
    batches = [{"x": torch.randn(4, 6), "y": torch.randint(0, 3, (4,))} for _ in range(2)]
    spec = DataSpec(batches)
    assert not spec.counts_tokens and spec.num_tokens_in_batch(batches[0]) == 0
    model = ClassifierModel(mlp(), num_classes=3)
    state = Trainer(
        model=model, train_dataloader=spec, max_duration="1ep", optimizers=torch.optim.SGD(model.parameters(), lr=0.1)
    ).fit()
    assert state.step == 2 and int(state.timestamp.sample) == 8
