"""Document masks: block-causal attention over packed sequences, so no token attends across a document.

A packed sequence (`raytrain_events.data.ray.packed_source.PackedTokens`) holds several documents
end to end; ``document_ids`` names each token's document (``-1`` on padding). Query ``i`` may see
key ``j`` when both are in the same document and ``j`` is not after ``i``: a block-diagonal causal
mask. Call it from a model's attention (``examples/transformer_lm.py`` does)::

    y = document_attention(q, k, v, batch["document_ids"], positions=batch.get("positions"))

Two kernels (``backend``): ``"sdpa"`` builds the boolean mask ``(rows, 1, queries, keys)`` and calls
``scaled_dot_product_attention`` with it (any device; O(queries * keys) bools per row, as the scores
themselves); ``"flex"`` uses torch's FlexAttention with a block mask (``create_block_mask``: blocks
wholly outside every document are skipped, so the cost follows the documents' own lengths),
compiled on CUDA (``torch.compile(flex_attention)``, once per process: uncompiled it materializes
the whole score matrix). ``"auto"`` picks ``"flex"`` on CUDA when torch has it and no
context-parallel cut is given, else ``"sdpa"``. On CPU (torch 2.13 here) FlexAttention runs
forward only, eager or compiled: its backward raises ``NotImplementedError`` ("does not support
backward on CPU"), so ``"auto"`` never picks it there and ``backend="flex"`` with gradients on CPU
is refused with the fix (``tests/parallel/test_document_attention.py`` pins that fact: the probe
fails once torch adds the backward). Padding tokens attend to earlier padding only (every query
sees at least itself, so no row of the softmax is empty); their outputs are never trained on (the
loss ignores them).

Batches in the ``cu_seqlens`` format (``PackedTokens(document_format="cu_seqlens")``: the batch's
document pieces as cumulative lengths over its rows laid end to end, each sequence's padding one
more piece, flash-attn's varlen layout, with ``max_seqlen`` and ``num_tokens``): `cu_seqlens_to_ids`
turns them into the same masks' ``document_ids`` (each piece's number in the batch, ``-1`` on
padding) and ``position_ids`` on the batch's device, O(tokens) torch work there instead of on the
host; `with_document_ids` turns such a batch into the ``document_ids`` format's, once per batch
(``examples/transformer_lm.py`` calls it first, so CP's cut and the labels work unchanged). Kernels
that take ``cu_seqlens`` themselves (flash-attn's ``flash_attn_varlen_func`` over
``input_ids.view(-1)``) can use the batch's as they are.

Context parallelism: a CP rank holds the queries at its global ``positions`` (the load-balanced cut,
`context_parallel.split_token_batch`, which leaves ``document_ids`` whole) while its attention runs
over the whole sequence's keys. The mask is built for those queries over all keys *in sequence
order* (``(rows, 1, len(positions), seq_len)``); `context_parallel.context_parallel_attention`
reorders its key axis to the order the keys were gathered in. Tensor parallelism splits heads; the
mask has one head axis of size 1 and broadcasts over however many heads a rank holds.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch

__all__ = [
    "PAD_DOCUMENT",
    "document_mask",
    "document_attention",
    "choose_backend",
    "flex_available",
    "cu_seqlens_to_ids",
    "with_document_ids",
]

PAD_DOCUMENT = -1  # as `raytrain_events.core.packing.PAD_DOCUMENT` (not imported: that module needs numpy)


def document_mask(document_ids: torch.Tensor, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The block-causal mask ``(rows, 1, queries, seq_len)`` (True: may attend) of the queries at
    ``positions`` (default: every position) over every key, from ``document_ids`` ``(rows, seq_len)``."""
    if document_ids.dim() != 2:
        raise ValueError(f"document_ids must be (rows, seq_len); got shape {tuple(document_ids.shape)}.")
    length = document_ids.shape[1]
    keys = torch.arange(length, device=document_ids.device)
    queries = keys if positions is None else positions.to(document_ids.device)
    query_docs = document_ids[:, queries]
    same = query_docs[:, :, None] == document_ids[:, None, :]
    causal = keys[None, :] <= queries[:, None]
    return (same & causal[None]).unsqueeze(1)


def cu_seqlens_to_ids(
    cu_seqlens: torch.Tensor, num_tokens: torch.Tensor, seq_len: Optional[int] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document_ids int64, position_ids int32)``, ``(rows, seq_len)`` each, of a ``cu_seqlens`` batch
    (``rows = len(num_tokens)``, ``seq_len = cu_seqlens[-1] // rows``): each token's piece number in
    the batch and its place in the piece; padding (after a row's ``num_tokens``) ``PAD_DOCUMENT`` and 0,
    as the ``document_ids`` format's padding. The positions are the ``document_ids`` format's; the ids
    differ in value only (pieces, not source documents), so every mask and label made from them is the same.
    ``seq_len``: the rows' length (``input_ids.shape[1]``; else read from ``cu_seqlens[-1]``, a device sync)."""
    rows = num_tokens.shape[0]
    if seq_len is None:
        seq_len = int(cu_seqlens[-1]) // rows if rows else 0
    total = rows * seq_len
    device = cu_seqlens.device
    index = torch.arange(total, device=device, dtype=cu_seqlens.dtype)
    piece = torch.searchsorted(cu_seqlens[1:].contiguous(), index, right=True)  # each token's piece
    positions = (index - cu_seqlens[piece]).to(torch.int32).view(rows, seq_len)
    pad = torch.arange(seq_len, device=device)[None, :] >= num_tokens.to(device)[:, None]
    documents = piece.view(rows, seq_len).masked_fill(pad, PAD_DOCUMENT)
    return documents, positions.masked_fill(pad, 0)


def with_document_ids(batch: Any) -> Any:
    """A ``cu_seqlens`` batch as the ``document_ids`` format's (a new dict: ``document_ids`` and
    ``position_ids`` from `cu_seqlens_to_ids` in place of ``cu_seqlens``/``max_seqlen``, the rest as
    it is); any other batch as it is. For models (and CP's or a pipeline's splits) written for ``document_ids``.

    The ids are computed once per batch: they are also written into ``batch`` itself, so a later call on
    the same dict (the loss after the forward, each pipeline block of a microbatch) reads them instead of
    converting again. A row split of that batch (`DataSpec.split_batch`) cuts them with the rest."""
    if not isinstance(batch, dict) or "cu_seqlens" not in batch:
        return batch
    if "document_ids" not in batch:
        seq_len = batch["input_ids"].shape[1] if "input_ids" in batch else None
        batch["document_ids"], batch["position_ids"] = cu_seqlens_to_ids(
            batch["cu_seqlens"], batch["num_tokens"], seq_len
        )
    return {k: v for k, v in batch.items() if k not in ("cu_seqlens", "max_seqlen")}


def flex_available() -> bool:
    """Whether this torch has FlexAttention (``torch.nn.attention.flex_attention``)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401  (a probe: torch >= 2.5)
    except ImportError:
        return False
    return True


def document_attention(  # noqa: PLR0913 (the attention's tensors, then how to mask and which kernel)
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    document_ids: torch.Tensor,
    positions: Optional[torch.Tensor] = None,
    *,
    scale: Optional[float] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Block-causal attention of ``query`` ``(rows, heads, queries, dim)`` over ``key``/``value``
    under ``document_ids`` (see module doc). ``positions``: the queries' global positions under a
    context-parallel cut (the keys are then the whole sequence's, gathered by the CP route)."""
    import torch.nn.functional as F

    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    if choose_backend(backend, query.is_cuda, positions is not None, grad) == "flex":
        return _flex(query, key, value, document_ids, scale)
    mask = document_mask(document_ids, positions)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)


def choose_backend(backend: str, cuda: bool, cut: bool, grad: bool) -> str:
    """The kernel `document_attention` runs: ``"flex"`` or ``"sdpa"`` (module doc), for tensors on
    CUDA or not, under a context-parallel cut or not, needing gradients or not; a choice that
    cannot run is refused naming the fix."""
    if backend not in ("auto", "sdpa", "flex"):
        raise ValueError(f"backend={backend!r}: give 'auto', 'sdpa' or 'flex'.")
    if backend == "auto":
        return "flex" if cuda and not cut and flex_available() else "sdpa"
    if backend == "flex":
        if cut:
            raise ValueError("backend='flex' does not take a context-parallel cut (positions): use 'sdpa' under CP.")
        if not flex_available():
            raise ValueError(f"backend='flex': torch {torch.__version__} has no FlexAttention; use 'sdpa' or 'auto'.")
        if grad and not cuda:
            raise ValueError(
                f"backend='flex' on CPU: torch {torch.__version__}'s FlexAttention has no backward on CPU "
                "(forward only). Train with backend='auto' or 'sdpa' there; 'flex' on CPU is for no_grad/eval."
            )
    return backend


def _flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, docs: torch.Tensor, scale: Any) -> torch.Tensor:
    # Deferred: FlexAttention imports its compile machinery (seconds) and only this path needs it.
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def block_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (docs[b, q] == docs[b, k]) & (k <= q)

    rows, length = docs.shape
    mask = create_block_mask(block_causal, rows, None, length, length, device=str(query.device))
    kernel = _compiled(flex_attention) if query.is_cuda else flex_attention
    out = kernel(query, key, value, block_mask=mask, scale=scale)
    return out if isinstance(out, torch.Tensor) else out[0]


@functools.lru_cache(maxsize=1)
def _compiled(flex_attention: Any) -> Any:
    """FlexAttention compiled once per process (the fused kernel; torchtitan compiles it the same way)."""
    return torch.compile(flex_attention, dynamic=False)
