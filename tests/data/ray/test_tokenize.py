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


def _flat_rows_are_refused(web: str, code: str, monkeypatch) -> None:
    import ray.data

    import raytrain_events.ray.cluster as cluster
    from raytrain_events import RayTrainer
    from raytrain_events.core.mixture import Mixture
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from tests.bad_input_helpers import ray_kwargs, unread_dataset

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started: the flat token rows should have been refused before")

    monkeypatch.setattr(cluster, "ensure_ray", refuse)
    fix = r"is a flat token file .*Fix: .*PackedTokens\('.*{}', seq_len=\.\.\.\)"
    for train in (ray.data.read_parquet(web), ParquetRowGroups(web), ParquetRowGroups(web, columns=["tokens"])):
        with pytest.raises(ValueError, match="datasets\\['train'\\] reads .*" + fix.format("web")):
            RayTrainer(**ray_kwargs(datasets={"train": train})).fit()
    with pytest.raises(ValueError, match="datasets\\['eval'\\] reads .*" + fix.format("code")):  # an eval set too
        RayTrainer(**ray_kwargs(datasets={"train": unread_dataset(), "eval": ray.data.read_parquet(code)})).fit()
    sources = {"web": ParquetRowGroups(web), "code": ray.data.read_parquet(code)}
    mixture = Mixture(sources={"web": 10, "code": 10}, weights={"web": 0.5, "code": 0.5})
    with pytest.raises(ValueError, match="datasets\\['code'\\] reads .*" + fix.format("code")):  # sorted first
        RayTrainer(**ray_kwargs(datasets=sources, mixture=mixture)).fit()
    monkeypatch.undo()


@pytest.mark.ray
def test_tokenize_is_exact_idempotent_and_resumable(ray_cluster, corpus, tmp_path, monkeypatch) -> None:
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    from raytrain_events.data.ray.packed_source import VOCAB_KEY, PackedTokens
    from raytrain_events.data.ray.token_files import LAYOUT_KEY, read_documents
    from raytrain_events.data.ray.tokenize import tokenize

    out = str(tmp_path / "tokens")
    kwargs = {"tokenizer": corpus["tokenizer"], "id_column": None, "group_tokens": 500}
    summary = tokenize({"web": corpus["web"], "code": [corpus["code"]]}, out, **kwargs)
    assert summary["written"] == 3 and summary["skipped"] == 0
    assert summary["sources"]["web"]["documents"] == 200 and summary["sources"]["code"]["empty"] == 1
    tok = Tokenizer.from_file(corpus["tokenizer"])
    table = read_documents(os.path.join(out, "web"))  # the flat layout (the default), as one row per document
    assert [tok.decode(ids) for ids in table["input_ids"].to_pylist()] == TEXTS[:200]
    assert table["num_tokens"].to_pylist() == [len(ids) for ids in table["input_ids"].to_pylist()]
    assert set(table["source"].to_pylist()) == {"web"}
    assert table["document_id"].to_pylist() == list(range(100)) + [2**32 + r for r in range(100)]
    meta = pq.ParquetFile(os.path.join(out, "web", "part-00000.parquet")).metadata
    assert meta.metadata[VOCAB_KEY] == b"300" and meta.num_row_groups > 3 and meta.metadata[LAYOUT_KEY] == b"flat"
    assert all(meta.row_group(g).num_rows < 100 for g in range(meta.num_row_groups))
    chunks = pq.read_table(os.path.join(out, "web", "part-00000.parquet"), columns=["chunk_tokens"])
    assert max(chunks["chunk_tokens"].to_pylist()) < 500 + 40  # row groups of about group_tokens tokens
    # Idempotent: nothing new. Resumable: a lost shard is redone alone, the same bytes of tokens.
    assert tokenize({"web": corpus["web"], "code": [corpus["code"]]}, out, **kwargs)["written"] == 0
    os.remove(os.path.join(out, "web", "part-00001.parquet"))
    again = tokenize({"web": corpus["web"], "code": [corpus["code"]]}, out, **kwargs)
    assert (again["written"], again["skipped"]) == (1, 2)
    assert read_documents(os.path.join(out, "web")).equals(table)
    packed = PackedTokens(os.path.join(out, "web"), seq_len=64, vocab_size=300)
    assert packed.real_tokens == sum(table["num_tokens"].to_pylist())
    # Bad input: the flat files read as plain Parquet rows (byte chunks) are refused before RayTrainer starts Ray,
    # through each user path (a bare read_parquet, ParquetRowGroups with or without columns, a mixture source).
    _flat_rows_are_refused(os.path.join(out, "web"), os.path.join(out, "code"), monkeypatch)
    # A shard of another input (or tokenizer), or of another layout, is refused, not mixed in.
    with pytest.raises(FileExistsError, match="already holds tokens of .*Fix: another output folder"):
        tokenize({"web": [corpus["code"]]}, out, **kwargs)
    with pytest.raises(FileExistsError, match="in the 'flat' layout, not layout='documents'.*Fix: layout='flat'"):
        tokenize({"web": corpus["web"]}, out, layout="documents", **kwargs)


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
                "--layout",
                "documents",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    assert summary["sources"]["code"]["documents"] == 100
    table = pq.read_table(os.path.join(out, "code"))  # the documents layout: one list row per document
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


@pytest.mark.ray
def test_the_cli_tokenizes_s3_to_s3_with_a_transformers_tokenizer_folder(
    ray_cluster, corpus, s3_server, tmp_path, capsys
) -> None:
    """Inputs and output on the S3 test server, a transformers tokenizer saved to a local folder (no
    network): the shards decode back to the text with that tokenizer, their footer holds its
    vocabulary (added tokens included), a rerun writes nothing, the output packs from S3; a
    tokenizer of more ids than the model's embedding, a missing tokenizer folder and a folder
    holding no tokenizer are refused by the CLI before any task, naming the fix."""
    pytest.importorskip("transformers")
    import pyarrow.parquet as pq
    import s3fs
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from raytrain_events.cli.main import main
    from raytrain_events.data.ray.packed_source import PackedTokens
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups
    from raytrain_events.data.ray.token_files import read_documents

    folder = str(tmp_path / "hf-tokenizer")
    hf = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(corpus["tokenizer"]), unk_token="[UNK]")
    hf.add_tokens(["<extra_0>", "<extra_1>"])  # ids past the BPE's: the vocabulary the footer must record
    hf.save_pretrained(folder)
    vocab = len(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    options = s3_server["storage_options"]
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    bucket = f"s3://{s3_server['bucket']}"
    fs.put(os.path.join(corpus["web"], "part-0.jsonl"), f"{bucket}/text/web/part-0.jsonl")
    flags = ["-o", f"key={options['key']}", "-o", f"secret={options['secret']}"]
    flags += ["-o", f"client_kwargs.endpoint_url={s3_server['endpoint']}", "-o", "client_kwargs.region_name=us-east-1"]
    argv = ["tokenize", f"web={bucket}/text/web/", "--output", f"{bucket}/tokens"]
    argv += ["--tokenizer", folder, "--eos", "<extra_1>", "--vocab-size", str(vocab)] + flags
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["written"] == 1 and summary["sources"]["web"]["documents"] == 100
    assert sorted(fs.ls(f"{bucket}/tokens/web")) == [f"{s3_server['bucket']}/tokens/web/part-00000.parquet"]
    with fs.open(f"{bucket}/tokens/web/part-00000.parquet", "rb") as f:
        meta = pq.ParquetFile(f).schema_arrow.metadata
    table = read_documents(f"{bucket}/tokens/web", storage_options=options)
    assert vocab == Tokenizer.from_file(corpus["tokenizer"]).get_vocab_size() + 2
    assert meta[b"raytrain_events.vocab_size"] == str(vocab).encode()
    assert [hf.decode(ids[:-1]) for ids in table["input_ids"].to_pylist()] == TEXTS[:100]
    assert {ids[-1] for ids in table["input_ids"].to_pylist()} == {vocab - 1}  # <extra_1> appended
    assert main(argv) == 0 and json.loads(capsys.readouterr().out)["written"] == 0  # idempotent on S3 too
    packed = PackedTokens(
        ParquetRowGroups(f"{bucket}/tokens/web", storage_options=options), seq_len=64, vocab_size=vocab
    )
    assert packed.real_tokens == sum(table["num_tokens"].to_pylist())
    with pytest.raises(ValueError, match=f"vocabulary of {vocab} tokens, more than vocab_size={vocab - 1}"):
        PackedTokens(
            ParquetRowGroups(f"{bucket}/tokens/web", storage_options=options), seq_len=64, vocab_size=vocab - 1
        )
    # Refused before any task (the output has no new shard): the model's embedding, missing or empty folders.
    bad = list(argv)
    bad[bad.index("--vocab-size") + 1] = str(vocab - 1)
    bad[bad.index("--output") + 1] = f"{bucket}/tokens-2"
    assert main(bad) == 2
    assert f"has {vocab} token ids, more than vocab_size={vocab - 1}" in capsys.readouterr().err
    for tokenizer, message in (
        (str(tmp_path / "no-such-folder"), "does not exist"),
        (str(tmp_path), "could not load the tokenizer folder"),
    ):
        bad[bad.index("--tokenizer") + 1] = tokenizer
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert message in err and "nothing is downloaded" in err, err
    assert not fs.exists(f"{bucket}/tokens-2")


def test_a_tokenizer_name_is_looked_up_in_the_local_cache_only(tmp_path, capsys) -> None:
    """A name ("org/name", as on the Hugging Face hub) that is no path here is loaded from the local
    cache only: one that is not there is refused by the CLI before anything runs, naming the fix
    (nothing is downloaded); a missing path is refused as a missing path, not looked up as a name."""
    pytest.importorskip("transformers")
    from raytrain_events.cli.main import main

    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "hello"}) + "\n")
    argv = ["tokenize", str(text), "--output", str(tmp_path / "out"), "--tokenizer"]
    assert main(argv + ["raytrain-events-tests/no-such-tokenizer"]) == 2
    err = capsys.readouterr().err
    assert "could not load it by that name from the local Hugging Face cache" in err and "nothing is downloaded" in err
    assert main(argv + ["./missing/tokenizer"]) == 2
    assert "The tokenizer file or folder './missing/tokenizer' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
