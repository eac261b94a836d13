"""A tiny language model trained on a 2-stage mixture of three pre-tokenized Parquet sources, on Ray.

    python examples/mixture.py                 # 2 Ray workers on this machine, under a minute on CPU
    python examples/mixture.py --workers 3 --out /tmp/mixture-demo

Writes three small pre-tokenized sources ("web", "code", "math": fixed-length int32 token rows,
each source its own token pattern) as Parquet files in a temporary folder, then trains on them
with ``RayTrainer(mixture=...)``: 70% web / 20% code / 10% math for the first half of the run,
then 30% / 30% / 40%. Each source is a ``ParquetRowGroups`` (a ``ray.data.read_parquet(folder)``
works too): a resume enters every source at its own cursor and reads nothing before it. At the end
it prints the tokens seen per source (summed on the loop's per-batch collective, the same
numbers the run report's "Tokens seen per source" table shows).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, Dict

SEQ = 32  # tokens per row
VOCAB = 64
SOURCES = {"web": 2000, "code": 800, "math": 400}  # rows
STAGES = {"0dur": {"web": 0.7, "code": 0.2, "math": 0.1}, "0.5dur": {"web": 0.3, "code": 0.3, "math": 0.4}}


def write_sources(folder: str, rows_per_group: int = 100) -> Dict[str, str]:
    """One folder of Parquet files per source: a ``tokens`` column of ``SEQ`` int32 tokens per row."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    out = {}
    for k, (name, rows) in enumerate(SOURCES.items()):
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        start = rng.integers(0, VOCAB, size=(rows, 1))
        tokens = ((start + np.arange(SEQ) * (k + 1)) % VOCAB).astype(np.int32)  # source k counts in steps of k+1
        for part in range(2):
            chunk = tokens[part * rows // 2 : (part + 1) * rows // 2]
            table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(chunk.reshape(-1)), SEQ)})
            pq.write_table(table, os.path.join(folder, name, f"part-{part}.parquet"), row_group_size=rows_per_group)
        out[name] = os.path.join(folder, name)
    return out


def tiny_lm() -> Any:
    """Embedding -> GRU -> next-token logits; ``loss`` is next-token cross-entropy on the ``tokens`` column."""
    import torch

    class TinyLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(VOCAB, 32)
            self.rnn = torch.nn.GRU(32, 32, batch_first=True)
            self.out = torch.nn.Linear(32, VOCAB)

        def forward(self, batch: Dict[str, Any]) -> Any:
            hidden, _ = self.rnn(self.embed(batch["tokens"][:, :-1].long()))
            return self.out(hidden)

        def loss(self, logits: Any, batch: Dict[str, Any]) -> Any:
            targets = batch["tokens"][:, 1:].long()
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    torch.manual_seed(0)
    return TinyLM()


def adamw(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=3e-3)


def tokens_in_batch(batch: Dict[str, Any]) -> int:
    return int(batch["tokens"].shape[0] * (SEQ - 1))  # predicted tokens


def run(data: str, storage: str, workers: int = 2, max_duration: str = "1ep", **options: Any) -> Any:
    """Train on the mixture of the sources under ``data``; returns the `RayResult`."""
    from raytrain_events import Mixture, RayTrainer
    from raytrain_events.ray import ParquetRowGroups

    folders = write_sources(data)
    mixture = Mixture(sources=SOURCES, stages=STAGES, epoch_size=1600)  # 1,600 rows an epoch, in two stages
    return RayTrainer(
        model=tiny_lm,
        optimizers=adamw,
        datasets={name: ParquetRowGroups(folder) for name, folder in folders.items()},
        mixture=mixture,
        global_batch_size=32,
        get_num_tokens_in_batch=tokens_in_batch,
        max_duration=max_duration,
        num_workers=workers,
        resources_per_worker={"CPU": 0.5},
        storage_path=storage,
        run_name="mixture",
        report_interval="25ba",
        progress_bar=False,
        **options,
    ).fit()


def tokens_per_source(result: Any) -> Dict[str, int]:
    """``{source: tokens}`` from the run's final history entry."""
    prefix = "mixture/tokens/"
    return {k[len(prefix) :]: int(v) for k, v in sorted(result.metrics.items()) if k.startswith(prefix)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=None, help="folder for the sources and the run (default: a temp folder)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="mixture-")
    result = run(os.path.join(out, "data"), os.path.join(out, "runs"), workers=args.workers)
    tokens = tokens_per_source(result)
    print(f"trained {result.timestamp.sample.value} samples, {result.timestamp.token.value} tokens")
    for name, count in tokens.items():
        print(f"tokens seen from {name}: {count} ({count / sum(tokens.values()):.1%})")
    line = report_line(result.run_url)
    if line:
        print(line)


def report_line(run_url: str) -> str:
    """Write the run's report (its tokens-per-source table and plots); the line naming it, '' if none was written."""
    from raytrain_events.report import write_report
    from raytrain_events.storage.fs import resolve

    report = write_report(run_url)["html"]
    fs, path = resolve(report)
    return f"run report: {report}" if fs.exists(path) else ""


if __name__ == "__main__":
    main()
