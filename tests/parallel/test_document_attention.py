"""Document masks (`raytrain_events.parallel.document_attention`) keep packed documents apart.

The check that fails on a leak: change one token of document A; no output of any other document
in the same sequence changes (and A's own later outputs do, so the check sees a change where one
is allowed). Whole on one process, and under context parallelism on 4 gloo ranks (the
load-balanced cut: each rank's queries attend over keys gathered from every rank), where the
gathered outputs equal the whole model's too. The same with the mask from ``cu_seqlens`` (the batch format of
``PackedTokens(document_format="cu_seqlens")``), whole and under CP.
"""

from __future__ import annotations

import pytest
import torch

from tests.parallel.doc_mask_workloads import SEQ, as_cu_seqlens, cp_logits, model, packed_batch
from tests.parallel.spawn import run_ranks

A = slice(5, 9)  # document 11 in row 0 (the changed token is at 7)


def _leaks(base: torch.Tensor, changed: torch.Tensor) -> dict:
    """Per region of row 0 and row 1, whether the change moved any output there."""
    moved = (base - changed).abs().amax(-1) > 1e-6
    return {
        "doc10": bool(moved[0, :5].any()),
        "doc11_before": bool(moved[0, 5:7].any()),
        "doc11_after": bool(moved[0, 7:9].any()),
        "doc12": bool(moved[0, 9:14].any()),
        "row1": bool(moved[1].any()),
    }


# The token changed in document 11 (row 0, position 7) moves only document 11's outputs from it on: not document
# 10 before it, not 11's own earlier tokens (causal), not document 12 after it in the same row, not row 1.
ONLY_DOC11_MOVES = {"doc10": False, "doc11_before": False, "doc11_after": True, "doc12": False, "row1": False}


def test_no_token_attends_across_a_document_and_the_check_sees_a_leak() -> None:
    net = model().eval()
    with torch.no_grad():
        base, changed = net(packed_batch()), net(packed_batch(change=True))
        assert _leaks(base, changed) == ONLY_DOC11_MOVES
        # Without document ids (plain causal attention over the packed row) document 12 sees the change:
        # the same check fails on a model that leaks.
        plain = {k: v for k, v in packed_batch().items() if k != "document_ids"}
        plain_changed = {k: v for k, v in packed_batch(change=True).items() if k != "document_ids"}
        assert _leaks(net(plain), net(plain_changed))["doc12"]


def test_a_mask_from_cu_seqlens_keeps_documents_apart_as_the_document_ids_one() -> None:
    """The built-in transformer on a cu_seqlens batch: no token attends across a document (the change in
    document 11 moves nothing of documents 10, 12 or row 1), the same logits and loss as from
    ``document_ids``; `cu_seqlens_to_ids` gives the same positions and padding, ids equal where they are."""
    from raytrain_events.parallel.document_attention import cu_seqlens_to_ids

    net = model().eval()
    cu_batch = as_cu_seqlens(packed_batch())
    docs, positions = cu_seqlens_to_ids(cu_batch["cu_seqlens"], cu_batch["num_tokens"])
    want = packed_batch()
    assert torch.equal(positions.long(), want["position_ids"].long()) and docs.dtype == torch.int64
    same = want["document_ids"][:, :, None] == want["document_ids"][:, None, :]
    assert torch.equal(docs[:, :, None] == docs[:, None, :], same) and torch.equal(docs < 0, want["document_ids"] < 0)
    with torch.no_grad():
        base, changed = net(cu_batch), net(as_cu_seqlens(packed_batch(change=True)))
        assert torch.equal(base, net(want))
        assert torch.equal(net.loss(base, cu_batch), net.loss(base, want))
    assert _leaks(base, changed) == ONLY_DOC11_MOVES
    # A cu_seqlens that merges documents 11 and 12 (a wrong boundary) lets 12 see the change: the check sees a leak.
    merged = {**cu_batch, "cu_seqlens": torch.tensor([0, 5, 14, 16, 25, 32], dtype=torch.int32)}
    merged_changed = {**as_cu_seqlens(packed_batch(change=True)), "cu_seqlens": merged["cu_seqlens"]}
    with torch.no_grad():
        assert _leaks(net(merged), net(merged_changed))["doc12"]


def test_padding_and_document_ends_carry_no_loss() -> None:
    from examples.transformer_lm import next_tokens

    labels = next_tokens(packed_batch())
    assert (labels[0, [4, 8, 13, 14, 15]] == -100).all() and (labels[1, [8, 15]] == -100).all()
    assert int((labels != -100).sum()) == (4 + 3 + 4) + (8 + 6)


def _qkv(change: bool = False) -> tuple:
    """Queries, keys and values of the packed batch's shape; ``change`` alters position 7 of row 0
    (document 11) in all three, as a changed token would."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, SEQ, 8, generator=g) for _ in range(3))
    if change:
        for t in (q, k, v):
            t[0, :, 7] += 1.0
    return q, k, v


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_flex_attention_matches_the_sdpa_mask_and_keeps_documents_apart(backend: str) -> None:
    """FlexAttention's block mask (forward, eager on CPU; compiled on CUDA) gives the SDPA mask's
    outputs, and for both kernels a change in document 11 moves no output of another document (plain
    causal attention over the same rows does: the check sees a leak)."""
    import torch.nn.functional as F

    from raytrain_events.parallel.document_attention import document_attention, flex_available

    if not flex_available():
        pytest.skip("this torch has no FlexAttention")
    docs = packed_batch()["document_ids"]
    with torch.no_grad():
        base, changed = (document_attention(*_qkv(c), docs, backend=backend) for c in (False, True))
        if backend == "flex":
            torch.testing.assert_close(base, document_attention(*_qkv(), docs, backend="sdpa"), atol=1e-5, rtol=1e-5)
        leaks = _leaks(base.transpose(1, 2).flatten(2), changed.transpose(1, 2).flatten(2))
        assert leaks == ONLY_DOC11_MOVES
        plain = (F.scaled_dot_product_attention(*_qkv(c), is_causal=True) for c in (False, True))
        assert _leaks(*(p.transpose(1, 2).flatten(2) for p in plain))["doc12"]


def test_flex_is_chosen_on_cuda_only_and_refused_for_training_on_cpu() -> None:
    """``backend="auto"`` picks FlexAttention on CUDA only (no CP cut); ``"flex"`` with gradients on
    CPU is refused naming the fix, before torch's kernel runs. The probe: torch's own CPU
    FlexAttention still has no backward (when this fails, torch added it: let ``"auto"`` pick flex on CPU)."""
    from raytrain_events.parallel.document_attention import choose_backend, document_attention, flex_available

    if not flex_available():
        pytest.skip("this torch has no FlexAttention")
    assert choose_backend("auto", cuda=True, cut=False, grad=True) == "flex"
    assert choose_backend("auto", cuda=True, cut=True, grad=True) == "sdpa"
    assert choose_backend("auto", cuda=False, cut=False, grad=False) == "sdpa"
    assert choose_backend("flex", cuda=False, cut=False, grad=False) == "flex"
    with pytest.raises(ValueError, match="does not take a context-parallel cut"):
        choose_backend("flex", cuda=True, cut=True, grad=False)
    with pytest.raises(ValueError, match="give 'auto', 'sdpa' or 'flex'"):
        choose_backend("xformers", cuda=True, cut=False, grad=False)
    q, k, v = (t.requires_grad_() for t in _qkv())
    docs = packed_batch()["document_ids"]
    with pytest.raises(ValueError, match="no backward on CPU.*backend='auto' or 'sdpa'"):
        document_attention(q, k, v, docs, backend="flex")
    document_attention(q, k, v, docs).sum().backward()  # "auto" trains on CPU (SDPA)
    assert q.grad is not None
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, SEQ, SEQ, device="cpu")
    with pytest.raises(NotImplementedError, match="does not support backward on CPU"):
        flex_attention(q, k, v, block_mask=mask).sum().backward()


@pytest.mark.timeout(600)
def test_context_parallel_4_keeps_documents_apart_and_matches_the_whole_model() -> None:
    results = run_ranks(4, cp_logits)
    net = model().train()
    with torch.no_grad():
        whole = net(packed_batch())
        whole_loss = float(net.loss(whole, packed_batch()))
    for r in results:
        torch.testing.assert_close(r["base"]["logits"], whole, atol=1e-5, rtol=1e-5)
        assert abs(r["base"]["loss"] - whole_loss) < 1e-5
        # The same batch in the cu_seqlens format: the model converts it before CP's cut, the same logits and loss.
        assert (
            torch.equal(r["cu_seqlens"]["logits"], r["base"]["logits"]) and r["cu_seqlens"]["loss"] == r["base"]["loss"]
        )
        assert _leaks(r["base"]["logits"], r["changed"]["logits"]) == ONLY_DOC11_MOVES


@pytest.mark.timeout(900)
def test_packed_training_under_cp_2_x_tp_2_matches_ddp() -> None:
    """Through the `Trainer` on 4 gloo ranks: CP 2 x TP 2 (one group) trains packed rows with document
    masks to DDP's losses and gradients, batch by batch, and counts each group's real tokens once. CP x TP's
    batches come as the Ray train loader ships them (segments, finished by the loader's ``device_transforms``
    before the CP split); DDP's as expanded rows."""
    from raytrain_events.data.ray.packed_batch import expand_batch
    from tests.parallel.doc_mask_workloads import packed_rows, segment_loader, train_packed

    rows = packed_rows(8, seed=100)
    shipped = next(iter(segment_loader(rows, 8)))
    assert "document_ids" not in shipped and "segment_lengths" in shipped
    finished = expand_batch(shipped)
    for k in ("input_ids", "document_ids", "position_ids"):
        want = torch.stack([r[k] for r in rows])
        assert finished[k].dtype == want.dtype and torch.equal(finished[k], want), k

    results = run_ranks(4, train_packed, ["ddp", "cp_tp"], {"ddp": 4, "cp_tp": 4})
    real = sum(int(r["num_tokens"]) for r in packed_rows(32, seed=100))
    for got in results:
        ddp, cp = got["ddp"], got["cp_tp"]
        assert cp["timestamp"]["token"] == real and ddp["timestamp"]["token"] == 4 * real
    mean = [sum(x) / 4 for x in zip(*(r["cp_tp"]["losses"] for r in results))]
    torch.testing.assert_close(mean, results[0]["ddp"]["losses"], rtol=1e-6, atol=0)
    for name, grad in results[0]["ddp"]["grads"].items():
        torch.testing.assert_close(results[0]["cp_tp"]["grads"][name], grad, rtol=0, atol=2e-6, msg=name)


@pytest.mark.timeout(900)
def test_packed_training_under_pp_2_x_dp_2_matches_ddp_for_each_schedule_and_keeps_documents_apart() -> None:
    """Through the `Trainer` on 4 gloo ranks (and, in the same spawn, PP 2 x TP 2 with 1F1B against DDP
    over its one data shard: the same checks): PP 2 x DP 2 (GPipe, 1F1B, and Interleaved 1F1B and Looped
    BFS with 2 stages per rank) trains packed rows with document masks on every stage (``pipeline_block``: each stage's
    blocks get their microbatch's document ids by the index that travels with the activations) to
    DDP's parameters and losses, with the Timestamp counting each pipeline's real tokens once; after
    training, predict (the stages forward only, one row per microbatch) gives DDP's logits and the
    leak check holds: changing a token of document 11 moves no output of another document. 1F1B trains
    the same from ``cu_seqlens`` batches, converting each microbatch to document ids once per rank."""
    from tests.parallel.doc_mask_workloads import PP_SCHEDULES, packed_rows, train_packed_pp

    results = run_ranks(4, train_packed_pp)
    real = [sum(int(r["num_tokens"]) for r in packed_rows(32, seed=100 + shard)) for shard in (0, 1)]
    ddp = results[0]["ddp"]
    assert ddp["losses"] != results[2]["ddp"]["losses"]  # the two data shards differ
    for schedule in PP_SCHEDULES:
        runs = [r[schedule] for r in results]
        merged: dict = {}
        for run in runs:
            merged.update(run["model"])
        assert sorted(merged) == sorted(ddp["model"])
        diff = max((merged[k] - ddp["model"][k]).abs().max().item() for k in merged)
        assert diff <= 1e-6, (schedule, diff)
        for run in runs:
            reference = results[2 * run["shard"]]["ddp"]  # the DDP ranks that loaded the same shard
            assert run["losses"] == pytest.approx(reference["losses"], abs=1e-5), schedule
            assert (run["timestamp"]["sample"], run["timestamp"]["token"]) == (64, sum(real)), schedule
            for got, expected in zip(run["predict"], ddp["predict"]):
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
            assert _leaks(*run["predict"]) == ONLY_DOC11_MOVES, schedule
    # PP 2 x TP 2 (1F1B; one data shard, so its reference is DDP with every rank on shard 0): stage
    # blocks split over 2 tensor ranks, heads split, the document mask broadcast over them.
    one = results[0]["ddp_one"]
    merged = {}
    for run in (r["1f1b_tp"] for r in results):
        merged.update(run["model"])
    assert sorted(merged) == sorted(one["model"])
    diff = max((merged[k] - one["model"][k]).abs().max().item() for k in merged)
    assert diff <= 2e-5, diff  # TP's split reductions round differently
    for run in (r["1f1b_tp"] for r in results):
        assert run["shard"] == 0 and run["losses"] == pytest.approx(one["losses"], abs=1e-5)
        assert (run["timestamp"]["sample"], run["timestamp"]["token"]) == (32, real[0])
        for got, expected in zip(run["predict"], one["predict"]):
            torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)
        assert _leaks(*run["predict"]) == ONLY_DOC11_MOVES
    # 1F1B on the same rows as cu_seqlens batches: the same training, each microbatch's document ids
    # computed once on each rank (not again for the loss or for each block of a stage).
    for plain, cu in ((r["1f1b"], r["1f1b_cu"]) for r in results):
        assert cu["losses"] == plain["losses"]
        assert [cu["timestamp"][k] for k in ("batch", "sample", "token")] == [
            plain["timestamp"][k] for k in ("batch", "sample", "token")
        ]
        assert all(torch.equal(cu["model"][k], plain["model"][k]) for k in plain["model"])
        assert cu["conversions"] == 4 * 2, cu["conversions"]  # 4 batches of 2 microbatches
