"""The loop on a CUDA GPU: no host sync inside a batch, in one process and under DDP.

Skipped where there is no GPU (CI has none); run on a GPU machine with ``python -m pytest tests/trainer/test_cuda.py``.
A host sync (``.item()``, a blocking copy, an event wait) stops the host from queueing kernels
while the GPU works, so the loop must make none inside a batch. Under DDP on a GPU the counters
take their host-side collective, never the GPU stream (`raytrain_events.trainer.counters`), and
must stay exact; with NCCL (a GPU per rank) the batches are checked for syncs too.
"""

from __future__ import annotations

import pytest
import torch
from gloo_ranks import SyncGuard, check_exact_counters, run_ranks, train

from raytrain_events import Trainer
from raytrain_events.models import ClassifierModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_one_gpu_batches_make_no_host_sync(precision):
    device = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 8, generator=g).to(device), torch.randint(0, 3, (32,), generator=g).to(device))] * 6
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    guard, optimizer = SyncGuard(), torch.optim.SGD(net.parameters(), lr=0.1)
    trainer = Trainer(
        model=ClassifierModel(net, num_classes=3),
        train_dataloader=batches,
        max_duration="2ep",
        optimizers=optimizer,
        schedulers=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1),  # stepped every batch
        precision=precision,
        callbacks=[guard],
        device=device,
    )
    try:
        state = trainer.fit()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert guard.batches == 12 and state.timestamp.sample == 12 * 32
    assert state.loss.is_cuda and torch.isfinite(state.loss)


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
@pytest.mark.parametrize("grad_accum", [1, 2])
def test_ddp_on_gpus_counts_exactly_on_the_host(backend, grad_accum):
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per rank")  # gloo ranks may share one GPU
    # gloo's own CUDA all-reduce syncs inside DDP's backward, so only NCCL runs guarded.
    guard = backend == "nccl"
    results = run_ranks(
        train, 2, backend=backend, cuda=True, device="cuda", grad_accum=grad_accum, epochs=2, sync_guard=guard
    )
    assert all(r["device"].startswith("cuda") and not r["on_gradients"] for r in results)
    check_exact_counters(results, 2, epochs=2)
