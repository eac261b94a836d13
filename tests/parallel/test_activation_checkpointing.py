"""FSDPConfig(activation_checkpointing=...) measured on 2 gloo ranks: the bytes autograd keeps
for backward drop, and the loss and gradients stay the same. (Training to DDP's parameters with
it on is in test_fsdp_training.py's ``fsdp_ac`` arm; the step-time cost is bench/activation_checkpointing.py.)"""

from __future__ import annotations

import torch

from tests.parallel.ac_workloads import measure_saved_activations
from tests.parallel.spawn import run_ranks


def test_activation_checkpointing_saves_less_and_changes_nothing():
    for rank, got in enumerate(run_ranks(2, measure_saved_activations)):
        plain, ac = got["plain"], got["ac"]
        assert len(plain["saved"]) == len(ac["saved"]) == 2  # one forward per batch
        for without, with_ac in zip(plain["saved"], ac["saved"]):
            # 4 blocks keep only their inputs (the embeddings, final norm, head and loss still save theirs)
            assert with_ac < 0.35 * without, (rank, plain["saved"], ac["saved"])
        torch.testing.assert_close(ac["losses"], plain["losses"], rtol=1e-6, atol=0)
        assert ac["grads"].keys() == plain["grads"].keys() and len(plain["grads"]) > 10
        for name, grad in plain["grads"].items():
            assert grad.abs().sum() > 0, name
            torch.testing.assert_close(ac["grads"][name], grad, rtol=0, atol=1e-6, msg=f"{name} rank {rank}")
