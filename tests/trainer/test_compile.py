"""``Trainer(compile=...)``: the model's forward runs through torch.compile, after INIT's model changes, under DDP too."""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import job_results, run_jobs, run_ranks
from oom_ranks import BATCH, OOMModel, dataset, make_trainer, train_compiled
from torch.utils.data import DataLoader

from raytrain_events import Algorithm, Event, Trainer
from raytrain_events.trainer.compiling import is_compiled


class SwapHeadAtInit(Algorithm):
    """Replaces the head at INIT (as StochasticDepth replaces blocks); records whether compile came first."""

    def __init__(self):
        self.compiled_at_init = None

    def match(self, event, state):
        return event == Event.INIT

    def apply(self, event, state, logger):
        self.compiled_at_init = is_compiled(state.model)
        torch.manual_seed(1)
        state.model.head = torch.nn.Linear(16, 3)


def make(compile):
    model = OOMModel()
    return make_trainer(model, compile=compile), model


def counting_backend(graphs):
    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return backend


def test_forward_runs_compiled_with_the_given_options_and_trains_the_same():
    graphs = []
    trainer, model = make({"backend": counting_backend(graphs)})
    trainer.fit()
    assert is_compiled(model) and len(graphs) >= 1  # dynamo traced forward and handed it to our backend
    assert "_orig_mod" not in "".join(model.state_dict())  # checkpoint keys unchanged
    eager, eager_model = make(False)
    eager.fit()
    assert not is_compiled(eager_model)
    for name, value in eager_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)


def test_compile_runs_after_init_algorithms_change_the_model():
    model = OOMModel()
    swap = SwapHeadAtInit()
    graphs = []
    trainer = Trainer(
        model=model,
        train_dataloader=DataLoader(dataset(), batch_size=BATCH),
        max_duration="1ba",
        optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
        algorithms=[swap],
        compile={"backend": counting_backend(graphs)},
    )
    assert swap.compiled_at_init is False and is_compiled(model)
    trainer.fit()
    # The traced graph calls the swapped-in head (the one INIT put there), whose weights it reads.
    traced = graphs[0]
    assert any("head" in str(node.target) or "head" in node.name for node in traced.graph.nodes)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc = torch.nn.Linear(6, 3)

    def forward(self, batch):
        return self.fc(batch[0])

    def loss(self, outputs, batch):
        return torch.nn.functional.cross_entropy(outputs, batch[1])


def test_inductor_on_cpu_matches_eager(monkeypatch):
    # Inductor sets this for the process; the test-env check would count it as a leak.
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "0")
    torch._dynamo.reset()
    results = []
    for compile in (True, False):  # the default backend (inductor, C++ on CPU): small, as compiling is slow here
        model = Linear()
        Trainer(
            model=model,
            train_dataloader=DataLoader(dataset(), batch_size=BATCH),
            max_duration="2ba",
            optimizers=torch.optim.SGD(model.parameters(), lr=0.1),
            compile=compile,
        ).fit()
        assert is_compiled(model) == compile
        results.append(model.state_dict())
    for name, value in results[1].items():
        torch.testing.assert_close(results[0][name], value, rtol=1e-4, atol=1e-5)


def test_compile_with_ddp_on_two_ranks():
    # One spawn, eager first (nothing compiled is left in the ranks when the eager job runs).
    ranks = run_ranks(run_jobs, 2, jobs=[(train_compiled, {"compiled": False}), (train_compiled, {"compiled": True})])
    eager, compiled = job_results(ranks, 0), job_results(ranks, 1)
    assert all(r["graphs"] >= 1 for r in compiled) and all(r["graphs"] == 0 for r in eager)
    for name, value in eager[0]["weights"].items():
        torch.testing.assert_close(compiled[0]["weights"][name], value)
        torch.testing.assert_close(compiled[1]["weights"][name], compiled[0]["weights"][name], rtol=0, atol=0)


@pytest.mark.parametrize("bad", [{"mode": "fast", "fullgraph": True, "speed": 2}, "yes", 1])
def test_bad_compile_options_are_refused(bad):
    with pytest.raises((ValueError, TypeError), match="compile="):
        make(bad)
