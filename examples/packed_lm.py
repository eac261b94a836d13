"""From text to packed sequences on Ray: a small GPT on the Python standard library's own text.

    python examples/packed_lm.py                      # 2 Ray workers on this machine, a few minutes on CPU
    python examples/packed_lm.py --workers 3 --tokens 4e5 --out /tmp/packed-demo

The whole path, on text every machine has:

1. **Text.** Three sources cut from the standard library (``sysconfig``'s ``stdlib`` folder):
   ``code`` (top-level functions and classes of ``Lib/*.py``), ``tests`` (the same from
   ``Lib/test/test_*.py``) and ``docs`` (the paragraphs of their docstrings, prose). One document per block,
   written as JSON lines (one file per 40 modules); the last file of each source is held out.
2. **A tokenizer.** A byte-level BPE (2,048 tokens) trained with Hugging Face ``tokenizers`` on
   the training files, saved as ``bpe.json``.
3. **Tokenize on Ray Data** (`raytrain_events.data.ray.tokenize.tokenize`, the same as
   ``raytrain-events tokenize``): one token Parquet shard per input file, resumable and idempotent.
4. **Pack.** Each source a `PackedTokens` of 128-token sequences: ``code`` and ``tests`` by
   greedy concatenation (long blocks split at sequence ends), ``docs`` by best fit (docstrings are
   short: none is split; a longer one would be refused, so they are cut to 128 tokens when tokenized).
5. **Mix and train.** ``RayTrainer(mixture=...)``: 50% code, 30% tests, 20% docs of the packed
   sequences; the example transformer (``examples/transformer_lm.py``) with document masks (no
   token attends across a document; positions restart at each document); the Timestamp counts
   real tokens (`count_real_tokens`), per source too.
6. **Per-source eval loss** on each source's held-out packed sequences, printed at the end with
   the tokens seen per source and the packing efficiency of each source.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import os
import sys
import sysconfig
import tempfile
from typing import Any, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import transformer_lm  # noqa: E402  (the example transformer, next to this file)
from ray import cloudpickle as _cloudpickle  # noqa: E402

_cloudpickle.register_pickle_by_value(transformer_lm)  # workers need not have examples/ on their path

SEQ, VOCAB = 128, 2048
MODULES_PER_FILE = 40
POLICY = {"code": "concat", "tests": "concat", "docs": "best_fit"}
WEIGHTS = {"code": 0.5, "tests": 0.3, "docs": 0.2}


def _paragraphs(text: Any) -> List[str]:
    """A docstring's paragraphs (blank-line separated), each a document of the ``docs`` source."""
    return [p.strip() for p in str(text).split("\n\n") if p.strip()]


def _blocks(path: str) -> List[Any]:
    """``(source text of each top-level def/class, their docstrings and the module's)`` of one file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        tree = ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return [[], []]
    code, docs = [], []
    lines = text.splitlines(keepends=True)
    if ast.get_docstring(tree):
        docs += _paragraphs(ast.get_docstring(tree))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            code.append("".join(lines[node.lineno - 1 : node.end_lineno]))  # not get_source_segment: O(file) each
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(
                    inner
                ):
                    docs += _paragraphs(ast.get_docstring(inner))
    return [code, docs]


def write_text(folder: str, modules: int = 160) -> Dict[str, List[str]]:
    """The three sources as JSON-lines files under ``folder/<source>/``; the last file of each is held out."""
    stdlib = sysconfig.get_paths()["stdlib"]
    lib = sorted(glob.glob(os.path.join(stdlib, "*.py")))[:modules]
    tests = sorted(glob.glob(os.path.join(stdlib, "test", "test_*.py")))[:modules]
    texts: Dict[str, List[List[str]]] = {"code": [], "tests": [], "docs": []}
    for name, files in (("code", lib), ("tests", tests)):
        for start in range(0, len(files), MODULES_PER_FILE):
            code, docs = [], []
            for path in files[start : start + MODULES_PER_FILE]:
                c, d = _blocks(path)
                code += c
                docs += d
            texts[name].append(code)
            if name == "code":
                texts["docs"].append(docs)
            else:
                texts["docs"][start // MODULES_PER_FILE] += docs
    out: Dict[str, List[str]] = {}
    for name, parts in texts.items():
        os.makedirs(os.path.join(folder, name), exist_ok=True)
        out[name] = []
        for i, part in enumerate(parts):
            path = os.path.join(folder, name, f"part-{i:02d}.jsonl")
            with open(path, "w") as f:
                f.writelines(json.dumps({"text": t}) + "\n" for t in part)
            out[name].append(path)
    return out


def train_tokenizer(files: List[str], path: str) -> str:
    """A byte-level BPE of `VOCAB` tokens trained on ``files`` (JSON lines), saved at ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts() -> Any:
        for file in files:
            with open(file) as f:
                for line in f:
                    yield json.loads(line)["text"]

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts(), trainer)
    tok.save(path)
    return path


def prepare(out: str) -> Dict[str, Any]:
    """Text, tokenizer, token Parquet and packed sources (train and held out) under ``out``."""
    from raytrain_events.data.ray.packed_source import PackedTokens
    from raytrain_events.data.ray.tokenize import tokenize

    files = write_text(os.path.join(out, "text"))
    train = {name: paths[:-1] for name, paths in files.items()}
    held = {f"eval_{name}": paths[-1:] for name, paths in files.items()}
    tokenizer = train_tokenizer([p for paths in train.values() for p in paths], os.path.join(out, "bpe.json"))
    inputs = {**train, **held}
    tokens = os.path.join(out, "tokens")
    split = {n: p for n, p in inputs.items() if POLICY[n.removeprefix("eval_")] == "concat"}
    whole = {n: p for n, p in inputs.items() if n not in split}  # best fit: cut to SEQ so that each fits
    counts = tokenize(split, tokens, tokenizer=tokenizer, eos="<eos>")["sources"]
    counts.update(tokenize(whole, tokens, tokenizer=tokenizer, eos="<eos>", max_tokens=SEQ)["sources"])
    packed = {
        name: PackedTokens(
            os.path.join(out, "tokens", name),
            seq_len=SEQ,
            policy=POLICY[name.removeprefix("eval_")],
            vocab_size=VOCAB,
            window_tokens=64 * SEQ,
        )
        for name in [*train, *held]
    }
    return {"tokenizer": tokenizer, "tokenize": counts, "packed": packed}


def eval_dataset(source: Any) -> Any:
    """A packed source's sequences (all of them, in order) as a Ray Dataset: an eval set."""
    import pyarrow as pa
    import ray

    from raytrain_events.data.ray.packed_reads import pack_read

    return ray.data.from_arrow(
        pa.concat_tables([pack_read(**source.window_args(w)) for w in range(len(source.windows))])
    )


def lm() -> Any:
    """The example transformer (document masks on packed batches) with an eval loss metric."""
    import torch
    from torchmetrics import MeanMetric
    from transformer_lm import TransformerLM  # this folder's (pickled by value to the workers: see below)

    class PackedLM(TransformerLM):
        def get_metrics(self, is_train: bool = False) -> Dict[str, Any]:
            return {} if is_train else {"loss": MeanMetric()}

        def update_metric(self, batch: Any, outputs: Any, metric: Any) -> None:
            metric.update(self.loss(outputs, batch).detach(), weight=int(batch["num_tokens"].sum()))

    torch.manual_seed(0)
    return PackedLM(vocab=VOCAB, width=96, heads=4, depth=2, length=SEQ)


def adamw(model: Any) -> Any:
    import torch

    return torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)


def run(out: str, workers: int = 2, tokens: str = "3e5", **options: Any) -> Dict[str, Any]:
    """Prepare the data and train; returns the result, the per-source numbers and the packing efficiency."""
    from raytrain_events import Mixture, RayTrainer
    from raytrain_events.data.ray.packed_source import count_real_tokens
    from raytrain_events.ray.cluster import ensure_ray

    ensure_ray(min_cpus=workers + 2)  # Ray Data (tokenize, reads) needs CPUs beside the train workers
    data = prepare(out)
    packed = data["packed"]
    train = {name: s for name, s in packed.items() if not name.startswith("eval_")}
    evals = {name: eval_dataset(s) for name, s in packed.items() if name.startswith("eval_")}
    mixture = Mixture(sources={n: s.count() for n, s in train.items()}, stages={"0dur": WEIGHTS})
    result = RayTrainer(
        model=lm,
        optimizers=adamw,
        datasets={**train, **evals},
        mixture=mixture,
        global_batch_size=16,
        batch_size=8,
        get_num_tokens_in_batch=count_real_tokens,
        max_duration=f"{tokens}tok",
        eval_interval="1dur",
        num_workers=workers,
        resources_per_worker={"CPU": 0.5},
        storage_path=os.path.join(out, "runs"),
        run_name="packed-lm",
        report_interval="50ba",
        progress_bar=False,
        **options,
    ).fit()
    efficiency = {n: s.real_tokens / (s.count() * SEQ) for n, s in train.items()}
    return {"result": result, "efficiency": efficiency, "tokenize": data["tokenize"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--tokens", default="3e5", help="real tokens to train on (default 3e5)")
    parser.add_argument("--out", default=None, help="folder for the data and the run (default: a temp folder)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="packed-lm-")
    done = run(out, workers=args.workers, tokens=args.tokens)
    result, metrics = done["result"], done["result"].metrics
    print(f"trained {result.timestamp.sample.value} sequences, {result.timestamp.token.value} real tokens")
    for name in WEIGHTS:
        loss = next((v for k, v in metrics.items() if k.endswith(f"eval_{name}/loss")), float("nan"))
        print(
            f"{name:5s}: {int(metrics.get(f'mixture/tokens/{name}', 0)):>8} tokens seen, packing efficiency "
            f"{done['efficiency'][name]:.3f} ({POLICY[name]}), held-out loss {float(loss):.3f}"
        )


if __name__ == "__main__":
    main()
