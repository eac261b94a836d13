"""`tokenize` / ``raytrain-events tokenize``: text to seekable token Parquet on Ray Data (the session's Ray).

A BPE tokenizer trained here with ``tokenizers`` on the inputs' own text; two sources, one of two
JSONL files and one of a Parquet file with an integer id column and an empty document. Checked:
each shard's documents decode back to their text, ids and sources kept, empty documents skipped
and counted, row groups of about ``group_tokens`` tokens, the vocabulary in the footer; a rerun
writes nothing (idempotent); a deleted shard is redone alone (resumable); the output packs
(`PackedTokens`); the CLI does the same. Refused before any task: a missing tokenizer file, a text
column that is not text, a shard made from another input.
"""

from __future__ import annotations

import json
import os

import pytest

TEXTS = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # number {i}" for i in range(300)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder = tmp_path_factory.mktemp("text")
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXTS, trainers.BpeTrainer(vocab_size=300, special_tokens=["[UNK]", "<eos>"]))
    tokenizer = str(folder / "bpe.json")
    tok.save(tokenizer)
    web = folder / "web"
    web.mkdir()
    for f in range(2):
        with open(web / f"part-{f}.jsonl", "w") as out:
            for text in TEXTS[f * 100 : (f + 1) * 100]:
                out.write(json.dumps({"text": text}) + "\n")
    code = str(folder / "code.parquet")
    pq.write_table(pa.table({"text": TEXTS[200:] + [""], "id": list(range(5000, 5101))}), code)
    return {"tokenizer": tokenizer, "web": str(web), "code": code, "folder": folder}


@pytest.mark.ray
def test_tokenize_is_exact_idempotent_and_resumable(ray_cluster, corpus, tmp_path) -> None:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from raytrain_events.data.ray.packed_source import VOCAB_KEY, PackedTokens
    from raytrain_events.data.ray.tokenize import tokenize

    out = str(tmp_path / "tokens")
    kwargs = {"tokenizer": corpus["tokenizer"], "id_column": None, "group_tokens": 500}
    summary = tokenize({"web": corpus["web"], "code": [corpus["code"]]}, out, **kwargs)
    assert summary["written"] == 3 and summary["skipped"] == 0
    assert summary["sources"]["web"]["documents"] == 200 and summary["sources"]["code"]["empty"] == 1
    tok = Tokenizer.from_file(corpus["tokenizer"])
    table = pq.read_table(os.path.join(out, "web"))
    assert [tok.decode(ids) for ids in table["input_ids"].to_pylist()] == TEXTS[:200]
    assert table["num_tokens"].to_pylist() == [len(ids) for ids in table["input_ids"].to_pylist()]
    assert set(table["source"].to_pylist()) == {"web"}
    assert table["document_id"].to_pylist() == list(range(100)) + [2**32 + r for r in range(100)]
    meta = pq.ParquetFile(os.path.join(out, "web", "part-00000.parquet")).metadata
    assert meta.metadata[VOCAB_KEY] == b"300" and meta.num_row_groups > 3
    assert all(meta.row_group(g).num_rows < 100 for g in range(meta.num_row_groups))
    # Idempotent: nothing new. Resumable: a lost shard is redone alone, the same bytes of tokens.
    assert tokenize({"web": corpus["web"], "code": [corpus["code"]]}, out, **kwargs)["written"] == 0
    os.remove(os.path.join(out, "web", "part-00001.parquet"))
    again = tokenize({"web": corpus["web"], "code": [corpus["code"]]}, out, **kwargs)
    assert (again["written"], again["skipped"]) == (1, 2)
    assert pq.read_table(os.path.join(out, "web")).equals(table)
    packed = PackedTokens(os.path.join(out, "web"), seq_len=64, vocab_size=300)
    assert packed.real_tokens == sum(table["num_tokens"].to_pylist())
    # A shard of another input (or tokenizer) is refused, not mixed in.
    with pytest.raises(FileExistsError, match="already holds tokens of .*Fix: another output folder"):
        tokenize({"web": [corpus["code"]]}, out, **kwargs)


@pytest.mark.ray
def test_the_cli_tokenizes_with_ids_and_refuses_bad_input(ray_cluster, corpus, tmp_path, capsys) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.cli.main import main
    from raytrain_events.data.ray.tokenize import tokenize

    out = str(tmp_path / "tokens")
    assert (
        main(
            [
                "tokenize",
                f"code={corpus['code']}",
                "--output",
                out,
                "--tokenizer",
                corpus["tokenizer"],
                "--id-column",
                "id",
                "--eos",
                "<eos>",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["sources"]["code"]["documents"] == 100
    table = pq.read_table(os.path.join(out, "code"))
    assert table["document_id"].to_pylist() == list(range(5000, 5100))
    assert all(ids[-1] == 1 for ids in table["input_ids"].to_pylist())  # <eos> appended
    with pytest.raises(FileNotFoundError, match="tokenizer file .*missing.json' does not exist.*nothing is downloaded"):
        tokenize(corpus["code"], out, tokenizer=str(tmp_path / "missing.json"))
    numbers = str(tmp_path / "numbers.parquet")
    pq.write_table(pa.table({"text": [1, 2, 3]}), numbers)
    with pytest.raises(TypeError, match="column 'text' is int64, not text"):
        tokenize(numbers, str(tmp_path / "t2"), tokenizer=corpus["tokenizer"])
    assert main(["tokenize", numbers, "--output", str(tmp_path / "t3"), "--tokenizer", corpus["tokenizer"]]) == 2
    assert "not text (string)" in capsys.readouterr().err
