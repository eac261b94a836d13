"""``examples/packed_lm.py``'s data path without its Ray run (fast tier): the standard library's text
cut into three sources, a BPE trained on it, each file tokenized (`tokenize_file`, the task the Ray
Data job runs), packed (`PackedTokens`, concat and best fit), and the example's model (the
transformer with document masks and an eval loss weighted by real tokens) on a packed batch.
The whole example on `RayTrainer` runs by hand (docs/data.md has its numbers)."""

from __future__ import annotations

import os

import numpy as np
import torch

from tests.example_scripts import load_example


def test_the_example_text_tokenizes_packs_and_trains_a_step(tmp_path) -> None:
    from raytrain_events.data.ray.packed_reads import pack_read
    from raytrain_events.data.ray.packed_source import PackedTokens
    from raytrain_events.data.ray.tokenize import tokenize_file

    example = load_example("packed_lm.py", "packed_lm_example")
    files = example.write_text(str(tmp_path / "text"), modules=6)
    assert set(files) == {"code", "tests", "docs"} and all(files.values())
    tokenizer = example.train_tokenizer([p for ps in files.values() for p in ps], str(tmp_path / "bpe.json"))
    sources = {}
    for name, paths in files.items():
        for i, path in enumerate(paths):
            counts = tokenize_file(
                path,
                str(tmp_path / "tok" / name / f"part-{i:05d}.parquet"),
                number=i,
                source=name,
                tokenizer=tokenizer,
                eos="<eos>",
                max_tokens=example.SEQ if name == "docs" else None,
            )
            assert counts["documents"] > 10 and counts["empty"] == 0
        sources[name] = PackedTokens(
            str(tmp_path / "tok" / name),
            seq_len=example.SEQ,
            policy=example.POLICY[name],
            vocab_size=example.VOCAB,
            window_tokens=16 * example.SEQ,
        )
        assert sources[name].real_tokens / (sources[name].count() * example.SEQ) > 0.9
    table = pack_read(**sources["docs"].window_args(0))
    batch = {
        k: torch.from_numpy(np.stack(table[k].to_numpy(zero_copy_only=False)))
        if k != "num_tokens"
        else torch.from_numpy(table[k].to_numpy())
        for k in table.column_names
    }
    batch = {k: v[:4] for k, v in batch.items()}
    model = example.lm()
    logits = model(batch)
    loss = model.loss(logits, batch)
    assert logits.shape == (4, example.SEQ, example.VOCAB) and 6.0 < float(loss) < 9.0  # about ln(2048) untrained
    loss.backward()
    metric = model.get_metrics()["loss"]
    model.update_metric(batch, logits.detach(), metric)
    assert abs(float(metric.compute()) - float(loss)) < 1e-5
    assert os.path.exists(tokenizer)
