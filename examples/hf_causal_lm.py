"""A Hugging Face causal LM (a small GPT-2 built from a config, random weights) on Ray Train workers,
with its duration and learning-rate schedule counted in tokens.

    pip install 'raytrain_events[hf]'
    python examples/hf_causal_lm.py                    # 2 workers, 2e4 tokens, ~a minute on CPU
    python examples/hf_causal_lm.py 1e5 4              # max tokens, workers

The data are random token rows of varying length, right-padded; ``count_tokens`` counts the
attention mask, so ``max_duration="2e4tok"`` means 20,000 real tokens summed over every worker,
whatever the padding or the number of workers, and the warmup (``t_warmup="0.1dur"``) is the first
10% of those tokens. Swap in your tokenizer's output (``input_ids``, ``attention_mask``, ``labels``)
and ``AutoModelForCausalLM.from_pretrained(...)`` for real training.
"""

from __future__ import annotations

import sys
import tempfile
from typing import Any, Dict, List

import numpy as np
import torch

from raytrain_events.hf import HuggingFaceModel, count_tokens

VOCAB, LENGTH = 256, 32


def make_rows(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    """``n`` rows of random tokens, each of its own length (the rest is padding)."""
    rng = np.random.default_rng(seed)
    return [{"ids": rng.integers(0, VOCAB, int(rng.integers(8, LENGTH + 1)))} for _ in range(n)]


def collate(batch: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    """Ray Data's numpy batch -> padded ``input_ids``, ``attention_mask``, ``labels`` (-100 at padding)."""
    rows = list(batch["ids"])
    ids = torch.zeros((len(rows), LENGTH), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.as_tensor(np.asarray(row, dtype=np.int64))
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def make_model(config: Dict[str, Any]) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4)
    return HuggingFaceModel(transformers.GPT2LMHeadModel(gpt2))


def make_optimizer(model: torch.nn.Module, config: Dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.get("lr", 3e-3))


def run(max_tokens: str = "2e4tok", num_workers: int = 2, storage: str = "", rows: int = 512) -> Any:
    """Train on Ray; returns the `RayResult` (its timestamp counts tokens over all workers)."""
    import ray.data

    from raytrain_events import RayTrainer
    from raytrain_events.schedulers import CosineAnnealingWithWarmupScheduler

    trainer = RayTrainer(
        model=make_model,
        optimizers=make_optimizer,
        schedulers=[CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur")],
        datasets={"train": ray.data.from_items(make_rows(rows))},
        collate_fn=collate,
        get_num_tokens_in_batch=count_tokens,
        max_duration=max_tokens,
        batch_size=16,
        num_workers=num_workers,
        storage_path=storage or tempfile.mkdtemp(prefix="hf-causal-lm-"),
        report_interval="1000tok",
        report_every_s=None,
    )
    return trainer.fit()


def main(argv: List[str]) -> int:
    max_tokens = f"{float(argv[0]):.0f}tok" if argv else "2e4tok"
    workers = int(argv[1]) if len(argv) > 1 else 2
    result = run(max_tokens, workers)
    losses = [(e["time/token"], e["train/loss"]) for e in result.history if "train/loss" in e]
    for tokens, loss in losses:
        print(f"tok {tokens:>8}  loss {loss:.3f}")
    print(f"final timestamp: {result.timestamp.token.value} tokens, {result.timestamp.batch.value} batches")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
