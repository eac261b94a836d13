"""Token files' flat layout (`token_files.py`) against the documents layout, no Ray.

The same documents (6 files x 3 row groups x 40 documents of a long-tail length mix, a few empty;
and 2 files x 2 row groups x 3,000 documents of up to 300 tokens) written in both layouts pack into
the very same blocks, window by window, under both policies, with the same counts on the driver, so
every exactness property the documents layout has (the same sequences at any world size, a resume
mid-window) holds for the flat one; `read_documents` reads both back alike. Bad input is refused
where the source is built or in the read task, naming the fix: a folder of mixed layouts, token ids
outside the vocabulary (from the footer's statistics, or from each chunk's least and greatest id
when the writer kept no statistics), a corrupt chunk, a layout this version does not know.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain_events.data.ray.packed_reads import pack_read, pack_reads
from raytrain_events.data.ray.packed_source import PackedTokens
from raytrain_events.data.ray.token_files import (
    LAYOUT_KEY,
    flat_schema,
    flat_table,
    flat_writer_options,
    read_documents,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from packed_data import VOCAB, write_tokens  # noqa: E402


@pytest.mark.parametrize("policy", ["concat", "best_fit"])
@pytest.mark.parametrize("shape", [(6, 3, 40, 40, 48, 500), (2, 2, 3000, 300, 512, 40_000)])
def test_the_flat_layout_packs_exactly_the_sequences_of_the_documents_layout(tmp_path, policy, shape) -> None:
    files, groups, docs, longest, seq_len, window = shape
    sources = {}
    for layout in ("documents", "flat"):
        paths, lengths = write_tokens(
            str(tmp_path / layout), files, groups, docs, seed=3, longest=longest, layout=layout
        )
        sources[layout] = PackedTokens(paths, seq_len=seq_len, policy=policy, window_tokens=window, vocab_size=VOCAB)
    documents, flat = sources["documents"], sources["flat"]
    assert flat.layout == "flat" and documents.layout == "documents"
    assert (flat.windows, flat.window_sequences, flat.window_bytes) == (
        documents.windows,
        documents.window_sequences,
        documents.window_bytes,
    )
    assert (flat.documents, flat.real_tokens) == (documents.documents, documents.real_tokens)
    assert flat.real_tokens == sum(lengths.values()) and len(flat.windows) >= 4
    every = list(range(len(flat.windows)))
    for group in flat.reads(every):  # each read task's block, several windows packed into one
        one = pack_reads([flat.window_args(w) for w in group])
        assert one.equals(pack_reads([documents.window_args(w) for w in group]))
    last = len(flat.windows) - 1
    assert pack_read(**flat.window_args(last)).equals(pack_read(**documents.window_args(last)))


def test_read_documents_reads_both_layouts_alike(tmp_path) -> None:
    tables = {}
    for layout in ("documents", "flat"):
        paths, lengths = write_tokens(str(tmp_path / layout), 3, 2, 50, seed=1, longest=30, layout=layout)
        tables[layout] = read_documents(str(tmp_path / layout)).select(["input_ids", "num_tokens", "document_id"])
    assert tables["flat"].equals(tables["documents"].cast(tables["flat"].schema))
    assert tables["flat"].num_rows == len(lengths) and tables["flat"]["num_tokens"].to_pylist() == list(
        lengths.values()
    )


def _flat_file(path: str, chunks, *, statistics: bool = True, layout: bytes = b"flat") -> str:
    options = flat_writer_options()
    if not statistics:
        options["write_statistics"] = False
    schema = flat_schema().with_metadata({LAYOUT_KEY: layout})
    with pq.ParquetWriter(path, schema, **options) as writer:
        for tokens, lengths in chunks:
            table = flat_table(np.asarray(tokens), np.asarray(lengths), np.arange(len(lengths)), "s")
            writer.write_table(table.replace_schema_metadata(schema.metadata))
    return path


def test_bad_flat_files_are_refused_naming_the_fix(tmp_path) -> None:
    good = [(np.arange(1, 61) % 50, [20, 30, 10])]
    (tmp_path / "mixed").mkdir()
    write_tokens(str(tmp_path / "mixed"), 1, 1, 10, seed=0)  # part-00.parquet: the documents layout
    _flat_file(str(tmp_path / "mixed" / "part-01.parquet"), good)
    with pytest.raises(ValueError, match="a 'flat' token file, .* a 'documents' one.*Fix: tokenize the source again"):
        PackedTokens(str(tmp_path / "mixed"), seq_len=16)
    # Token ids outside the vocabulary: from the footers' statistics where the source is built...
    big = _flat_file(str(tmp_path / "big.parquet"), good + [([5, 70, 3], [3])])
    with pytest.raises(
        ValueError, match=r"row group 1: token ids 3\.\.70 are outside the model's vocabulary \[0, 64\)"
    ):
        PackedTokens(big, seq_len=16, vocab_size=64)
    # ...else from each chunk's least and greatest id in the read task, before packing.
    quiet = _flat_file(str(tmp_path / "quiet.parquet"), good + [([5, 70, 3], [3])], statistics=False)
    source = PackedTokens(quiet, seq_len=16, vocab_size=64)
    with pytest.raises(ValueError, match=r"token ids 3\.\.70 are outside the model's vocabulary \[0, 64\)\. Fix"):
        pack_reads([source.window_args(w) for w in range(len(source.windows))])
    assert PackedTokens(quiet, seq_len=16, vocab_size=71).real_tokens == 63
    with pytest.raises(ValueError, match="layout 'flat-9', which this version does not read.*Fix: read it with"):
        PackedTokens(_flat_file(str(tmp_path / "new.parquet"), good, layout=b"flat-9"), seq_len=16)
    # A chunk whose bytes do not hold its lengths' tokens.
    corrupt = flat_table(np.arange(10), np.array([4, 6]), np.arange(2), "s")
    corrupt = corrupt.set_column(1, "lengths", pa.array([np.array([4, 7], "<i4").tobytes()], pa.large_binary()))
    pq.write_table(corrupt, str(tmp_path / "corrupt.parquet"), **flat_writer_options())
    with pytest.raises(ValueError, match="do not agree: a corrupt flat token file"):
        source = PackedTokens(str(tmp_path / "corrupt.parquet"), seq_len=4)
        pack_reads([source.window_args(w) for w in range(len(source.windows))])
    with pytest.raises(ValueError, match="10 tokens, 1 lengths and 2 ids do not agree"):
        flat_table(np.arange(10), np.array([10]), np.arange(2), "s")


def test_tokenize_file_writes_either_layout_and_any_codec_to_the_same_documents(tmp_path) -> None:
    """`tokenize_file` (the task `tokenize` runs; no Ray): the flat layout, compressed or not, holds the
    documents layout's documents and packs into the same sequences; a codec or layout that does not
    exist is refused by `tokenize` before anything starts, naming the ones that do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from raytrain_events.data.ray.tokenize import tokenize, tokenize_file

    texts = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 37)}" for i in range(200)]
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "<eos>"]))
    tok.save(str(tmp_path / "bpe.json"))
    pq.write_table(pa.table({"text": texts}), str(tmp_path / "text.parquet"))
    tables, packed = {}, {}
    for name, layout, codec in (("documents", "documents", None), ("flat", "flat", None), ("zstd", "flat", "zstd")):
        shard = str(tmp_path / name / "part-00000.parquet")
        counts = tokenize_file(
            str(tmp_path / "text.parquet"),
            shard,
            number=0,
            source="s",
            tokenizer=str(tmp_path / "bpe.json"),
            group_tokens=500,
            eos="<eos>",
            layout=layout,
            compression=codec,
        )
        assert counts["documents"] == 200
        tables[name] = read_documents(shard)
        packed[name] = PackedTokens(shard, seq_len=64, policy="best_fit", vocab_size=200)
        if codec:
            assert pq.ParquetFile(shard).metadata.row_group(0).column(0).compression == "ZSTD"
    assert tables["flat"].equals(tables["documents"]) and tables["zstd"].equals(tables["documents"])
    blocks = {k: pack_reads([p.window_args(w) for w in range(len(p.windows))]) for k, p in packed.items()}
    assert blocks["flat"].equals(blocks["documents"]) and blocks["zstd"].equals(blocks["documents"])
    with pytest.raises(ValueError, match="compression='bogus' is not a Parquet codec.*'none', 'snappy'"):
        tokenize(str(tmp_path / "text.parquet"), str(tmp_path / "t"), tokenizer="x", compression="bogus")
    with pytest.raises(ValueError, match="layout='rows' is not one of"):
        tokenize(str(tmp_path / "text.parquet"), str(tmp_path / "t"), tokenizer="x", layout="rows")
