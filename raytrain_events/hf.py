"""Hugging Face ``transformers`` models in the loop (``pip install raytrain_events[hf]``).

`HuggingFaceModel` wraps a ``transformers`` model (a ``PreTrainedModel``) so it follows the loop's
model protocol: ``forward(batch)`` calls ``model(**batch)`` with the batch's tensors the model's
forward accepts, ``loss`` is the loss the model computed from ``labels`` in the batch, and the eval
metrics are the language-model cross-entropy and perplexity over the predicted tokens (labels
``-100`` are ignored, as Hugging Face does). `count_tokens` counts a batch's real tokens from its
``attention_mask``, for durations and schedules in tokens::

    model = HuggingFaceModel(AutoModelForCausalLM.from_config(config))
    Trainer(model=model, train_dataloader=DataSpec(loader, get_num_tokens_in_batch=count_tokens),
            max_duration="1e7tok", ...)

``transformers`` is imported by the user's code, never here: this module only calls the model.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Mapping, Optional

import torch
import torch.nn.functional as F
from torchmetrics import Metric

__all__ = ["HuggingFaceModel", "LanguageCrossEntropy", "LanguagePerplexity", "count_tokens"]

IGNORE_INDEX = -100  # Hugging Face's label for "no loss here" (padding, prompt tokens)


def count_tokens(batch: Mapping[str, Any]) -> int:
    """Real (unpadded) tokens in ``batch``: the sum of ``attention_mask``, else every ``input_ids`` entry."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return int(mask.sum())
    return int(batch["input_ids"].numel())


class LanguageCrossEntropy(Metric):
    """Mean next-token cross-entropy over every predicted token (labels shifted left, -100 ignored)."""

    full_state_update = False

    def __init__(self, shift: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.shift = shift  # causal LMs predict token t+1 at position t
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        if self.shift:
            logits, labels = logits[..., :-1, :], labels[..., 1:]
        flat_labels = labels.reshape(-1)
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), flat_labels, ignore_index=IGNORE_INDEX, reduction="sum"
        )
        self.total += loss.double()
        self.count += (flat_labels != IGNORE_INDEX).sum()

    def compute(self) -> torch.Tensor:
        return (self.total / self.count.clamp(min=1)).float()


class LanguagePerplexity(LanguageCrossEntropy):
    """``exp`` of `LanguageCrossEntropy`."""

    def compute(self) -> torch.Tensor:
        return torch.exp(super().compute())


class HuggingFaceModel(torch.nn.Module):
    """A ``transformers`` model as a loop model: loss from the model output, LM metrics.

    Args:
        model: a ``transformers`` model whose output has ``loss`` when the batch has ``labels``.
        shift_labels: the metrics shift labels left (True for causal LMs, False for masked LMs).
        metrics: eval metrics ``{name: torchmetrics.Metric}`` updated with ``(logits, labels)``;
            default cross-entropy and perplexity.
    """

    def __init__(
        self, model: torch.nn.Module, *, shift_labels: bool = True, metrics: Optional[Dict[str, Metric]] = None
    ) -> None:
        super().__init__()
        self.model = model
        self.shift_labels = shift_labels
        self._metrics = metrics
        signature = inspect.signature(model.forward)
        takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
        self._accepted = None if takes_kwargs else set(signature.parameters)

    def forward(self, batch: Mapping[str, Any]) -> Any:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"HuggingFaceModel takes dict batches (input_ids, attention_mask, labels, ...), got {type(batch).__name__}."
            )
        inputs = {k: v for k, v in batch.items() if self._accepted is None or k in self._accepted}
        return self.model(**inputs)

    def loss(self, outputs: Any, batch: Mapping[str, Any]) -> torch.Tensor:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else getattr(outputs, "loss", None)
        if loss is None:
            raise ValueError(
                "The Hugging Face model returned no loss: put 'labels' in the batch (for a causal LM, labels = "
                "input_ids with -100 at padding)."
            )
        result: torch.Tensor = loss
        return result

    def eval_forward(self, batch: Mapping[str, Any], outputs: Any = None) -> Any:
        return outputs if outputs is not None else self.forward(batch)

    def get_metrics(self, is_train: bool = False) -> Dict[str, Metric]:
        if self._metrics is not None:
            return dict(self._metrics)
        return {
            "language_cross_entropy": LanguageCrossEntropy(shift=self.shift_labels),
            "language_perplexity": LanguagePerplexity(shift=self.shift_labels),
        }

    def update_metric(self, batch: Mapping[str, Any], outputs: Any, metric: Metric) -> None:
        logits = outputs["logits"] if isinstance(outputs, Mapping) else outputs.logits
        metric.update(logits, batch["labels"])
