"""Hugging Face adapter: a tiny randomly initialised GPT-2 (built from a config, no download) trains in
the loop with its own loss, token counts from the attention mask, and LM metrics equal to a hand computation."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from raytrain_events import DataSpec, Trainer
from raytrain_events.hf import HuggingFaceModel, count_tokens

transformers = pytest.importorskip("transformers")  # the [hf] extra; part of the [test] extra

VOCAB, LENGTH, ROWS = 40, 12, 32


def rows():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(ROWS):
        ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
        real = 4 + i % (LENGTH - 4)  # right padding: the rest is pad
        mask = (torch.arange(LENGTH) < real).long()
        labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": labels})
    return out


def collate(batch):
    return {k: torch.stack([row[k] for row in batch]) for k in batch[0]}


def tiny_gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=LENGTH,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


def test_tiny_causal_lm_trains_counts_tokens_and_reports_metrics():
    data = rows()
    loader = DataLoader(data, batch_size=8, collate_fn=collate)
    model = HuggingFaceModel(tiny_gpt2())
    first = collate(data[:8])
    with torch.no_grad():
        initial = model.model(**first).loss
    losses = []

    from raytrain_events import Callback

    class Losses(Callback):
        def batch_end(self, state, logger):
            losses.append(float(state.loss))

    tokens_per_epoch = sum(int(r["attention_mask"].sum()) for r in data)
    trainer = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=count_tokens),
        eval_dataloader=DataLoader(data, batch_size=16, collate_fn=collate),
        max_duration=f"{3 * tokens_per_epoch}tok",
        optimizers=torch.optim.AdamW(model.parameters(), lr=3e-2),
        callbacks=[Losses()],
    )
    trainer.fit()
    # Durations in tokens count the attention mask (not the padded length): exactly 3 epochs.
    assert trainer.state.timestamp.get_value("tok") == 3 * tokens_per_epoch
    assert trainer.state.timestamp.get_value("ep") == 3
    assert losses[0] == pytest.approx(float(initial), rel=1e-5)  # the loss is the model's own
    assert losses[-1] < losses[0]  # and it trains
    metrics = trainer.eval()
    with torch.no_grad():
        logits = torch.cat([model.model(**collate(data[i : i + 16])).logits for i in range(0, ROWS, 16)])
    labels = torch.stack([r["labels"] for r in data])
    ce = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    assert float(metrics["metrics/eval/language_cross_entropy"]) == pytest.approx(float(ce), rel=1e-5)
    assert float(metrics["metrics/eval/language_perplexity"]) == pytest.approx(float(torch.exp(ce)), rel=1e-5)


def test_missing_labels_and_non_dict_batches_are_explained():
    model = HuggingFaceModel(tiny_gpt2())
    batch = collate(rows()[:2])
    outputs = model({k: v for k, v in batch.items() if k != "labels"})
    with pytest.raises(ValueError, match="put 'labels' in the batch"):
        model.loss(outputs, batch)
    with pytest.raises(TypeError, match="dict batches"):
        model((batch["input_ids"], batch["labels"]))
    assert count_tokens(batch) == int(batch["attention_mask"].sum()) < batch["input_ids"].numel()
