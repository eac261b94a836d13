"""Packing: efficiency of both policies, tokenization throughput, and the data path's cost of packing.

    PYTHONPATH=$PWD python bench/packing.py                 # all three parts, 3 repeats
    PYTHONPATH=$PWD python bench/packing.py --parts efficiency
    PYTHONPATH=$PWD python bench/packing.py --parts cpu --repeats 5    # no Ray: CPU per sequence

Four parts (issue 50), each printed as a table with medians and spreads ``[min-max]``:

1. ``efficiency``: real tokens / sequence capacity and the documents split, for ``concat`` and
   ``best_fit`` (`raytrain_events.core.packing.efficiency`, windows of ``256 * seq_len`` tokens as
   `PackedTokens` makes them), on the example's corpus (``examples/packed_lm.py``: the standard
   library's functions and classes, and its docstrings, tokenized with the example's BPE; seq_len
   128) and on a synthetic long tail (log-normal lengths, median 300 tokens, seq_len 2048,
   documents longer than seq_len cut to it for best_fit). Pure arithmetic: no repeats needed.
2. ``tokenize``: documents/s of `tokenize` (Ray Data, one task per input file, on a local Ray of
   ``--cpus`` CPUs) against the plain per-process loop (`tokenize_file` over the same files one
   after another in this process), the same tokenizer and inputs; each repeat into a fresh folder.
3. ``datapath``: steady sequences/s of an epoch through the feeder and 2 ranks' loaders
   (`GlobalOrderLoader`, as `RayTrainer` builds them) for `PackedTokens` over flat token files
   (`token_files.py`, as `tokenize` writes them: 32 files of 2 row groups of 16,000 documents, about
   1 Mi tokens each;
   packing in the read tasks) against `ParquetRowGroups` over the very same sequences written out
   pre-packed (fixed-size int32/int64 lists): the cost of packing on the data path; and against
   those sequences' ``input_ids`` alone (fixed-length token rows, written uncompressed: what a run
   without packing or document masks reads, a quarter of the bytes), for both policies. The
   pre-packed sources read as many sequences per task and ahead of the feeder as `PackedTokens`
   does (`ParquetRowGroups` sizes reads by the footers' encoded bytes, far below the decoded ones for
   these columns: left at its defaults it would hold the whole epoch read ahead, and the arm would
   measure the loaders draining memory); and `PackedTokens` over the same token files packed offline by
   `pack_tokens` (the same sequences, read with no packing work). The first 32 batches (the feeder's start and the
   first read-ahead) are left out. `PackedTokens` in both document formats (``document_format=
   "cu_seqlens"``: the batch carries ``cu_seqlens`` instead of per-token ids; each batch's keys are
   checked, so the format is seen to survive the object store). Arms interleaved, in an order rotated
   per repeat, ``--repeats`` each; the ratios are per repeat. Each arm runs ``--epochs`` epochs (default
   3) of one feeder, measured from its 33rd batch: one epoch is about a second here, and a window that
   short held the feeder's start, the read tasks' workers starting and the first read-ahead. A second
   table gives each arm's CPU per sequence summed over every process of the path (the loaders here, the
   feeder, the read tasks' workers, Ray's own), which on these shared cores is what bounds the rate and
   moves far less with the load than the rate does.
4. ``cpu``: the data path's CPU work per sequence without Ray (in this process, CPU time, so a
   loaded machine moves it less than wall time), both sides of the object store: the read tasks
   (`pack_reads`: read the token row groups and pack; for the flat layout its read
   (`window_inputs`) and `pack_runs` apart; the same documents in the documents layout as a whole)
   and the ranks (`packed_tensors` of each rank's part of a batch, 32 sequences, as the loader makes
   it, in either document format: ``document_ids`` shipped as segments, O(runs + sequences) numbers that
   the loop finishes on the device, or, as before, expanded per token on the host; or ``cu_seqlens``), against the same sequences as fixed-length token rows (their ``input_ids`` alone, read by
   `_read_units` as `ParquetRowGroups`' read tasks do, then `table_to_torch`: the same token budget
   without packing or document masks; written with `pq.write_table`'s defaults and uncompressed, the
   cheaper of the two per repeat being the baseline). The last three columns are the goal's measure:
   rows/s of the packed path over the fixed-length one where CPU bounds it (the inverse ratio of the
   totals), for the flat layout in each document format and for the documents layout; and the same sequences packed offline
   (`pack_tokens`, asserted equal block by block) read by `PackedTokens` (``pre-packed``: the read task's views, then
   the rank, in either format), with the offline pack's own throughput (Mi real tokens/s, one thread, into a fresh
   folder per repeat, reading the token files and writing the packed ones included). Every arm once
   per repeat, in an order rotated per repeat, each the least CPU time (``time.process_time``) of 3
   runs; medians and ranges of the per-repeat ratios, and the load average printed with the table. ``concat`` on Zipf lengths up to 2,000, ``best_fit`` on the same mix cut
   at 1,024 tokens; 64,000 documents in row groups of 16,000 (about 1 Mi tokens, `tokenize`'s
   default), seq_len 1024, windows of ``256 * seq_len`` tokens. A second table weighs the device side on this
   CPU: `packed_batch.expand_batch` of the shipped batches (on CPU it takes NumPy's repeat), the torch kernels an
   accelerator runs (here on CPU tensors: torch's CPU kernels), and one train step of a small model (the example
   transformer, 2 blocks 64 wide, on 8 of the sequences), all per sequence, and the expansion's share of the step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict, List, Tuple

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
# the packing tests' token files (`write_tokens`)
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "ray"))


def _spread(values: List[float], digits: int = 1) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def corpus(out: str) -> Dict[str, Any]:
    """The example's text, tokenizer and token files (in this process, no Ray)."""
    import packed_lm

    from raytrain_events.data.ray.tokenize import tokenize_file

    files = packed_lm.write_text(os.path.join(out, "text"))
    tokenizer = packed_lm.train_tokenizer([p for ps in files.values() for p in ps], os.path.join(out, "bpe.json"))
    return {"files": files, "tokenizer": tokenizer, "tokenize_file": tokenize_file}


def efficiency_part(data: Dict[str, Any], out: str) -> None:
    from raytrain_events.core.packing import efficiency
    from raytrain_events.data.ray.token_files import read_documents

    lengths_by = {}
    for name, paths in data["files"].items():
        shards = []
        for i, path in enumerate(paths):
            shard = os.path.join(out, "eff", name, f"part-{i:05d}.parquet")
            data["tokenize_file"](path, shard, number=i, source=name, tokenizer=data["tokenizer"], eos="<eos>")
            shards.append(shard)
        lengths_by[name] = read_documents(shards)["num_tokens"].to_numpy()
    for name in list(lengths_by):
        lengths_by[f"stdlib {name} (seq 128)"] = lengths_by.pop(name)
    rng = np.random.default_rng(0)
    lengths_by["log-normal tail (seq 2048)"] = np.maximum(1, rng.lognormal(np.log(300), 1.2, size=200_000)).astype(int)
    lengths_by["0.5-0.6 seq_len (seq 2048)"] = rng.integers(1025, 1229, size=20_000)  # best_fit's worst case
    print("\n## Packing efficiency (real tokens / capacity)\n")
    print(
        "| corpus | documents | longer than seq_len | concat | concat: documents split "
        "| best_fit (long ones cut) | tokens the cut drops |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, lengths in lengths_by.items():
        seq = 128 if name.startswith("stdlib") else 2048
        concat = efficiency(lengths, seq, "concat", 256 * seq)
        best = efficiency(np.minimum(lengths, seq), seq, "best_fit", 256 * seq)
        dropped = float(np.maximum(lengths - seq, 0).sum()) / float(lengths.sum())
        print(
            f"| {name} | {len(lengths)} | {int((lengths > seq).sum())} | {concat['efficiency']:.4f} | "
            f"{int(concat['split_documents'])} | {best['efficiency']:.4f} | {dropped:.1%} |"
        )


def tokenize_part(data: Dict[str, Any], out: str, repeats: int) -> None:
    from raytrain_events.data.ray.tokenize import tokenize

    files = [p for ps in data["files"].values() for p in ps]
    plain, job, docs = [], [], 0
    for r in range(repeats):
        start = time.perf_counter()
        docs = 0
        for i, path in enumerate(files):
            docs += data["tokenize_file"](
                path,
                os.path.join(out, f"plain{r}", f"part-{i:05d}.parquet"),
                number=i,
                source="s",
                tokenizer=data["tokenizer"],
            )["documents"]
        plain.append(docs / (time.perf_counter() - start))
        start = time.perf_counter()
        summary = tokenize(files, os.path.join(out, f"job{r}"), tokenizer=data["tokenizer"])
        assert summary["sources"]["train"]["documents"] == docs
        job.append(docs / (time.perf_counter() - start))
    print("\n## Tokenization throughput (documents/s)\n")
    print(f"{len(files)} input files, {docs} documents; Ray Data job on this machine's local Ray\n")
    print("| plain loop (one process) | tokenize (Ray Data) | ratio |")
    print("| --- | --- | --- |")
    print(f"| {_spread(plain)} | {_spread(job)} | {_spread([j / p for j, p in zip(job, plain)], 2)} |")


def _write_prepacked(source: Any, path: str, columns: Any = None, plain: bool = False) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from raytrain_events.data.ray.packed_reads import pack_read

    os.makedirs(path, exist_ok=True)
    tables = [pack_read(**source.window_args(w)) for w in range(len(source.windows))]
    table = pa.concat_tables(tables)
    pq.write_table(
        table.select(columns or table.column_names),
        os.path.join(path, "packed.parquet"),
        row_group_size=tables[0].num_rows,
        **({"compression": "none", "use_dictionary": False} if plain else {}),
    )


def _cpu_seconds() -> Dict[int, float]:
    """CPU seconds so far of this process and every process under it (the local Ray it started: GCS,
    raylet, the feeder, the read tasks' workers, ...), by pid."""
    import psutil

    me = psutil.Process()
    out = {}
    for proc in [me] + me.children(recursive=True):
        try:
            times = proc.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        out[proc.pid] = times.user + times.system
    return out


def _steady_rate(
    ray: Any, source: Any, world: int = 2, batch: int = 64, skip: int = 32, epochs: int = 3
) -> Tuple[float, float]:
    """``(sequences/s, CPU us per sequence of every process of the path)`` over ``epochs`` epochs of one
    feeder, from batch ``skip`` of the first: the feeder's start and first read-ahead left out, and a
    window long enough (each epoch is about a second here) that the read tasks' workers, which Ray
    starts as the reads ask for them, are warm for most of it. The CPU is the machine's whole cost of the
    path (this process's two loaders, the feeder actor, the read tasks, Ray's own processes), summed over
    the processes alive at the window's end; on a shared machine it moves far less than the rate."""
    from raytrain_events.data.ray.feeder import FEEDER_OPTIONS, EpochFeeder
    from raytrain_events.data.ray.loader import GlobalOrderLoader, GlobalOrderShard

    feeder = ray.remote(EpochFeeder).options(**FEEDER_OPTIONS).remote(source, world, batch)
    loaders = [
        GlobalOrderLoader(GlobalOrderShard(feeder, r, world, batch, source.count()), device="cpu") for r in range(world)
    ]
    rows, start, before = 0, 0.0, None
    for epoch in range(epochs):
        for loader in loaders:
            loader.set_epoch(epoch)
            loader.set_position(0)
        for k, per_rank in enumerate(zip(*loaders)):
            if epoch == 0 and k == skip:
                start, rows, before = time.perf_counter(), 0, _cpu_seconds()
            for b in per_rank:  # the same per-batch work in both arms: every token read once
                rows += int(b["input_ids"].shape[0])
                int(b["input_ids"].sum())
                assert "cu_seqlens" in b or source.schema.names == list(b), (list(b), source.schema.names)
    wall = time.perf_counter() - start
    after = _cpu_seconds()
    ray.kill(feeder)
    assert before is not None
    cpu = sum(t - before.get(pid, 0.0) for pid, t in after.items())
    return rows / wall, cpu / rows * 1e6


def datapath_part(out: str, repeats: int, epochs: int = 3) -> None:
    head = (
        "| policy | tokens only (input_ids rows, no masks) | pre-packed (all 4 columns) | PackedTokens "
        "(packing in the read tasks) | PackedTokens, cu_seqlens | PackedTokens over pack_tokens' output (packed "
        "offline) | PackedTokens / pre-packed | PackedTokens / tokens only | cu_seqlens / tokens only "
        "| packed offline / tokens only |"
    )
    rows, cpus, notes = [], [], []
    load = os.getloadavg()
    for policy, longest in (("concat", 2_000), ("best_fit", 1_024)):
        row, cpu, note = _datapath_row(os.path.join(out, f"datapath-{policy}"), policy, longest, repeats, epochs)
        rows.append(row)
        cpus.append(cpu)
        notes.append(note)
    print(f"\n## Data path: steady sequences/s, 2 ranks, batches of 64 sequences of 1024 tokens, {epochs} epochs\n")
    print(head + "\n" + "| --- " * 10 + "|\n" + "\n".join(rows))
    print("\n## Data path: CPU us per sequence, every process (this one's loaders, the feeder, read tasks, Ray's)\n")
    print(head.replace(" / ", " / (CPU) ") + "\n" + "| --- " * 10 + "|\n" + "\n".join(cpus))
    print(
        "\n(CPU ratios: the inverse ratio of the CPU per sequence, the rows/s where the machine's CPU bounds the path.)"
    )
    print(f"load average (1 min) {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} CPUs")
    print("\n" + "\n".join(notes))


def _datapath_row(folder: str, policy: str, longest: int, repeats: int, epochs: int) -> Any:
    """Five arms over the very same sequences, interleaved per repeat: `PackedTokens` (both document
    formats, and over `pack_tokens`' output); the sequences written pre-packed (what it yields: 16 bytes
    per token); their ``input_ids`` alone (fixed-length token rows, as a run without packing and
    document masks reads: 4 bytes per token). Each arm ``epochs`` epochs of one feeder (`_steady_rate`)."""
    import ray
    from packed_data import write_tokens

    from raytrain_events.data.ray.pack_tokens import pack_tokens
    from raytrain_events.data.ray.packed_source import PackedTokens
    from raytrain_events.data.ray.parquet_seek import AHEAD_BYTES, READ_BYTES, ParquetRowGroups

    paths, _ = write_tokens(
        os.path.join(folder, "tok"), files=32, groups=2, docs_per_group=16_000, seed=0, longest=longest, layout="flat"
    )
    packed = PackedTokens(paths, seq_len=1024, policy=policy, window_tokens=256 * 1024)
    arms: Dict[str, Any] = {}
    for name, columns in (("tokens", ["input_ids"]), ("prepacked", None)):
        # Reads sized as PackedTokens sizes its own (sequences per task, bytes ahead of the feeder):
        # ParquetRowGroups sizes them by the footers' encoded bytes, here far below the decoded ones.
        _write_prepacked(packed, os.path.join(folder, name), columns, plain=name == "tokens")
        footer = ParquetRowGroups(os.path.join(folder, name))
        encoded = sum(footer.sizes.values()) / sum(packed.window_bytes)
        arms[name] = ParquetRowGroups(
            os.path.join(folder, name), read_bytes=int(READ_BYTES * encoded), ahead_bytes=int(AHEAD_BYTES * encoded)
        )
        assert arms[name].count() == packed.count()
    arms["packed"] = packed
    arms["cu"] = PackedTokens(
        paths, seq_len=1024, policy=policy, window_tokens=256 * 1024, document_format="cu_seqlens"
    )
    pack_tokens(paths, os.path.join(folder, "offline"), seq_len=1024, policy=policy)
    arms["offline"] = PackedTokens(os.path.join(folder, "offline"), seq_len=1024, policy=policy)
    assert arms["offline"].window_sequences == packed.window_sequences
    rates: Dict[str, List[float]] = {name: [] for name in arms}
    cpus: Dict[str, List[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(repeats):  # interleaved, in an order rotated per repeat
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rate, cpu = _steady_rate(ray, arms[name], epochs=epochs)
            rates[name].append(rate)
            cpus[name].append(1 / cpu)  # sequences per CPU us: its ratios are the inverse of the CPU's

    def cells(values: Dict[str, List[float]], scale: Any) -> str:
        ratios = [[a / b for a, b in zip(values[x], values[y])] for x, y in _RATIOS]
        shown = " | ".join(_spread([scale(v) for v in values[name]]) for name in _ARMS)
        return f"| {policy} | {shown} | " + " | ".join(_spread(r, 3) for r in ratios) + " |"

    note = (
        f"{policy}: {packed.count()} sequences from {packed.documents} documents ({packed.real_tokens} tokens); per "
        f"epoch {len(packed.windows)} windows (bundles) in {len(packed.reads(list(range(len(packed.windows)))))} "
        f"read tasks, tokens only {len(arms['tokens'].units)} row groups in "
        f"{len(arms['tokens'].reads(arms['tokens'].units))}"
    )
    return cells(rates, float), cells(cpus, lambda v: 1 / v), note


_ARMS = ("tokens", "prepacked", "packed", "cu", "offline")
_RATIOS = (("packed", "prepacked"), ("packed", "tokens"), ("cu", "tokens"), ("offline", "tokens"))


def _cpu_per_sequence(work: Any, sequences: int, tries: int = 3) -> float:
    """CPU time of ``work`` per sequence (us), the least of ``tries`` runs: another session's burst on the
    shared cores (cache and memory bandwidth taken, not time: CPU time leaves preemption out) only adds."""
    best = float("inf")
    for _ in range(tries):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return best / sequences * 1e6


def cpu_part(out: str, repeats: int) -> None:
    print(
        "\n## Data path CPU per sequence (us; no Ray; seq_len 1024, row groups of 16,000 documents, "
        "ranks' batches of 32)\n"
    )
    print(
        "| policy | fixed-length rows: default write | uncompressed | packed, documents layout "
        "| packed, flat layout: read | pack_runs | rank: document_ids (segments shipped) | rank: document_ids "
        "expanded on the host (before) | rank: cu_seqlens "
        "| packed, flat layout: in all (document_ids) | pre-packed: read | pre-packed: in all (read + rank) "
        "| rows/s packed / fixed-length: flat, document_ids | flat, document_ids expanded on the host (before) "
        "| flat, cu_seqlens | documents, document_ids "
        "| pre-packed, document_ids | pre-packed, cu_seqlens | pack offline: Mi tokens/s, 1 thread |"
    )
    print("| --- " * 19 + "|")
    load = os.getloadavg()
    device = []
    for policy, longest in (("concat", 2_000), ("best_fit", 1_024)):
        row, step = _cpu_row(os.path.join(out, f"cpu-{policy}"), policy, longest, repeats)
        print(row)
        device.append(step)
    print(f"\nload average (1 min) {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after; {os.cpu_count()} CPUs")
    print(
        "\n## The device side: the per-token columns made from the shipped segments, against a small model's step "
        "(us per sequence, CPU time, this machine's CPU as the device)\n"
    )
    print(
        "| policy | expand_batch (on CPU: NumPy's repeat) | torch kernels on CPU (what an accelerator runs) "
        "| train step, TransformerLM 2 x 64 wide, 8 x 1024 tokens | expand_batch / step | torch kernels / step |"
    )
    print("| --- " * 6 + "|")
    print("\n".join(device))


def _step_work() -> Any:
    """One train step (forward, loss, backward, SGD) of the example transformer (2 blocks, 64 wide, vocabulary
    4096) on a rank's part of 8 packed sequences of 1024 tokens: the small model whose step the device-side
    expansion is weighed against."""
    import torch
    from transformer_lm import TransformerLM

    torch.manual_seed(0)
    net = TransformerLM(vocab=4096, width=64, heads=4, depth=2, length=1024)
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)

    def step(batch: Dict[str, Any]) -> None:
        loss = net.loss(net(batch), batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    return step


def _cpu_row(folder: str, policy: str, longest: int, repeats: int) -> Tuple[str, str]:  # noqa: PLR0914, PLR0915
    """The data path's CPU work per sequence, both sides of the object store, arms interleaved: the
    read tasks (`pack_reads`: read the token row groups and pack, the same documents written in either
    layout, `token_files.py`, in row groups of about 1 Mi tokens as `tokenize` writes them; or
    `_read_units` of the same sequences' ``input_ids`` alone written out as fixed-length rows: the same
    token budget without packing or document masks, once with `pq.write_table`'s defaults (snappy,
    dictionary) and once uncompressed without a dictionary, the cheaper of the two per repeat being
    the baseline) and the ranks (`packed_tensors` of each rank's part of a batch, 32 sequences, as the
    loader makes it, in both document formats, ``PackedTokens(document_format=...)``; or
    `table_to_torch` alone). Rows/s of the data path with packing
    against without, where CPU bounds it, is the inverse ratio of the totals. Each repeat measures every
    arm once, in an order rotated per repeat (so a slow spell of the shared machine falls on different
    arms); the ratios are per repeat, their median and range printed."""
    from packed_data import write_tokens

    from raytrain_events.core.packing import pack_runs
    from raytrain_events.core.segments import _expand_segments_kernels
    from raytrain_events.data.ray.batch_tensors import table_to_torch
    from raytrain_events.data.ray.pack_tokens import pack_tokens
    from raytrain_events.data.ray.packed_batch import FORMAT_KEY, SEGMENT_COLUMNS, expand_batch, packed_tensors
    from raytrain_events.data.ray.packed_reads import pack_reads, window_inputs
    from raytrain_events.data.ray.packed_source import PackedTokens
    from raytrain_events.data.ray.parquet_seek import ParquetRowGroups, _read_units

    reads, args = {}, {}
    for layout in ("documents", "flat"):
        paths, _ = write_tokens(
            os.path.join(folder, layout),
            files=2,
            groups=2,
            docs_per_group=16_000,
            seed=0,
            longest=longest,
            layout=layout,
        )
        source = PackedTokens(paths, seq_len=1024, policy=policy, window_tokens=256 * 1024, vocab_size=4096)
        windows = list(range(len(source.windows)))
        args[layout] = [source.window_args(w) for w in windows]
        reads[layout] = [[args[layout][w] for w in group] for group in source.reads(windows)]
    n = source.count()
    tokens = source.real_tokens

    def pack_offline(k: int) -> float:  # Mi tokens/s of `pack_tokens` (one thread), into a fresh folder
        start = time.perf_counter()
        pack_tokens(paths, os.path.join(folder, f"prepacked-{k}"), seq_len=1024, policy=policy, workers=1)
        return tokens / (time.perf_counter() - start) / 2**20

    pack_offline(0)
    pre = PackedTokens(os.path.join(folder, "prepacked-0"), seq_len=1024, policy=policy, vocab_size=4096)
    pre_reads = [[pre.window_args(w) for w in group] for group in pre.reads(windows)]
    fixed = {}
    for name, plain in (("default", False), ("plain", True)):  # fixed-length token rows: the unpacked path
        _write_prepacked(source, os.path.join(folder, name), ["input_ids"], plain=plain)
        rows = ParquetRowGroups(os.path.join(folder, name))
        fixed[name] = (rows.paths, [[(f, g) for f, g, _ in group] for group in rows.reads(rows.units)])
    inputs = [window_inputs(a) for a in args["flat"]]

    def rank(blocks: List[Any], packed: bool, expand: bool = False) -> None:  # each rank's part, as the loader makes it
        for block in blocks:
            for at in range(0, block.num_rows, 32):
                part = [block.slice(at, 32)]
                packed_tensors(part, expand=expand) if packed else table_to_torch(part[0])

    def unpacked(name: str) -> float:
        paths, groups = fixed[name]
        blocks = [_read_units(paths, r, None, None) for r in groups]
        return _cpu_per_sequence(lambda: [_read_units(paths, r, None, None) for r in groups], n) + _cpu_per_sequence(
            lambda: rank(blocks, False), n
        )

    blocks = [pack_reads(r) for r in reads["flat"]]
    assert all(a.equals(b) for a, b in zip(blocks, [pack_reads(r) for r in reads["documents"]]))
    cu_blocks = [b.replace_schema_metadata({FORMAT_KEY: b"cu_seqlens"}) for b in blocks]  # as document_format= makes
    pre_blocks = [pack_reads(r) for r in pre_reads]
    assert all(a.equals(b) for a, b in zip(blocks, pre_blocks))  # the very same sequences
    # The device side: the shipped batches (each rank's part of 32 sequences), finished as the loop does, against
    # one small model's step on 8 of those sequences (all on this CPU).
    shipped = [packed_tensors([b.slice(at, 32)], expand=False) for b in blocks for at in range(0, b.num_rows, 32)]
    kernels = [tuple(batch[k] for k in SEGMENT_COLUMNS) + tuple(batch["input_ids"].shape) for batch in shipped]
    step = _step_work()
    step_batch = expand_batch(packed_tensors([blocks[0].slice(0, 8)], expand=False))
    for got, want in zip(map(expand_batch, shipped[:4]), (packed_tensors([blocks[0].slice(a, 32)]) for a in (0, 32))):
        assert all(got[k].dtype == want[k].dtype and bool((got[k] == want[k]).all()) for k in want)
    work = {
        "default": lambda: unpacked("default"),
        "plain": lambda: unpacked("plain"),
        "documents": lambda: _cpu_per_sequence(lambda: [pack_reads(r) for r in reads["documents"]], n),
        "read": lambda: _cpu_per_sequence(lambda: [window_inputs(a) for a in args["flat"]], n),
        "pack": lambda: _cpu_per_sequence(lambda: [pack_runs(t, k, i, 1024, policy) for t, k, i in inputs], n),
        "rank": lambda: _cpu_per_sequence(lambda: rank(blocks, True), n),
        "rank_host": lambda: _cpu_per_sequence(lambda: rank(blocks, True, expand=True), n),
        "rank_cu": lambda: _cpu_per_sequence(lambda: rank(cu_blocks, True), n),
        "device": lambda: _cpu_per_sequence(lambda: [expand_batch(batch) for batch in shipped], n),
        "kernels": lambda: _cpu_per_sequence(lambda: [_expand_segments_kernels(*k) for k in kernels], n),
        "step": lambda: _cpu_per_sequence(lambda: step(step_batch), 8),
        "pre_read": lambda: _cpu_per_sequence(lambda: [pack_reads(r) for r in pre_reads], n),
        "offline": lambda: pack_offline(len(arms["offline"]) + 1),
    }
    arms: Dict[str, List[float]] = {k: [] for k in work}
    unpacked("default")  # imports torch: outside the timed repeats
    names = list(work)
    for r in range(repeats):  # arms interleaved, in an order rotated per repeat
        for name in names[r % len(names) :] + names[: r % len(names)]:
            arms[name].append(work[name]())
    flat = [r + p + k for r, p, k in zip(arms["read"], arms["pack"], arms["rank"])]
    flat_host = [r + p + k for r, p, k in zip(arms["read"], arms["pack"], arms["rank_host"])]
    flat_cu = [r + p + k for r, p, k in zip(arms["read"], arms["pack"], arms["rank_cu"])]
    documents = [d + k for d, k in zip(arms["documents"], arms["rank"])]
    # Pre-packed blocks are the on-the-fly ones (asserted above): the rank's arms measure both.
    prepacked = [r + k for r, k in zip(arms["pre_read"], arms["rank"])]
    prepacked_cu = [r + k for r, k in zip(arms["pre_read"], arms["rank_cu"])]
    base = [min(d, p) for d, p in zip(arms["default"], arms["plain"])]
    cells = [_spread(arms["default"]), _spread(arms["plain"]), _spread(documents)]
    cells += [_spread(arms[k]) for k in ("read", "pack", "rank", "rank_host", "rank_cu")] + [_spread(flat)]
    cells += [_spread(arms["pre_read"]), _spread(prepacked)]
    totals = (flat, flat_host, flat_cu, documents, prepacked, prepacked_cu)
    cells += [_spread([a / t for a, t in zip(base, total)], 3) for total in totals]
    cells += [_spread(arms["offline"], 2)]
    shares = [[x / s for x, s in zip(arms[k], arms["step"])] for k in ("device", "kernels")]
    device = [_spread(arms["device"], 2), _spread(arms["kernels"], 1), _spread(arms["step"], 0)]
    device += [f"{statistics.median(r):.3%} [{min(r):.3%}-{max(r):.3%}]" for r in shares]
    return f"| {policy} | " + " | ".join(cells) + " |", f"| {policy} | " + " | ".join(device) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="efficiency,tokenize,datapath,cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per datapath arm (default 3)")
    parser.add_argument("--cpus", type=int, default=4, help="logical CPUs of the local Ray (default 4)")
    parser.add_argument(
        "--code",
        default=None,
        help="import raytrain_events from this tree instead (compare two trees' parts; a tree without the flat "
        "layout cannot run the cpu part)",
    )
    args = parser.parse_args()
    if args.code:
        sys.path.insert(0, os.path.abspath(args.code))
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-packing-") as out:  # about 1.5 GB for the datapath part
        data = corpus(out) if {"efficiency", "tokenize"} & set(parts) else {}
        if "efficiency" in parts:
            efficiency_part(data, out)
        if {"tokenize", "datapath"} & set(parts):
            from raytrain_events.ray.cluster import ensure_ray

            ensure_ray(num_cpus=args.cpus)
        if "tokenize" in parts:
            tokenize_part(data, out, args.repeats)
        if "datapath" in parts:
            datapath_part(out, args.repeats, args.epochs)
        if "cpu" in parts:
            cpu_part(out, args.repeats)


if __name__ == "__main__":
    main()
