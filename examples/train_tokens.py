"""A character-level language model whose length, LR schedule and logging are counted in tokens.

    python examples/train_tokens.py                          # local Trainer, 2e5 tokens, ~a minute on CPU
    python examples/train_tokens.py --ray num_workers=2      # the same on Ray Train workers
    python examples/train_tokens.py max_duration=5e5tok warmup=2e4tok log_every=5e4tok
    python examples/train_tokens.py --help                   # every option and config key

The text is the Python standard library's own source (a few files next to ``os.py``, present on
every machine), cut into variable-length sequences (``min_len``..``max_len`` characters). Each
batch is padded, and ``get_num_tokens_in_batch`` counts only the real (non-padding) target
characters, so ``max_duration="2e5tok"`` means 200,000 predicted characters whatever the
batch size, the padding or the number of workers: on Ray the global Timestamp sums every
worker's tokens. The learning rate warms up and decays by tokens too
(``CosineAnnealingWithWarmupScheduler(t_warmup="0.1dur")`` = the first 10% of the tokens),
and the loss is printed every ``log_every`` tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from raytrain_events import Callback, DataSpec, Trainer
from raytrain_events.cli import ArgumentParser, UsageError, keys_help, load_config, run_guarded

VOCAB = 128  # ASCII; other characters map to '?'
PAD, IGNORE = 0, -100  # NUL never occurs in source files; -100 is cross_entropy's ignore_index


@dataclass
class TokensConfig:
    max_duration: str = field(
        default="2e5tok",
        metadata={
            "help": "Training length; tokens (2e5tok) or any Time string (3ep, 300ba).",
            "time": True,
            "dur": False,
        },
    )
    warmup: str = field(
        default="0.1dur",
        metadata={
            "help": "Linear LR warmup before cosine decay: 0.1dur = the first 10% of max_duration's tokens.",
            "time": True,
            "zero_ok": True,
        },
    )
    log_every: str = field(
        default="2e4tok",
        metadata={
            "help": "Print the training loss every this many tokens (a Time string).",
            "time": True,
            "dur": False,
        },
    )
    lr: float = field(default=3e-3, metadata={"help": "Peak learning rate (AdamW)."})
    batch_size: int = field(default=32, metadata={"help": "Sequences per batch (per worker with --ray)."})
    min_len: int = field(default=16, metadata={"help": "Shortest sequence, in characters."})
    max_len: int = field(default=128, metadata={"help": "Longest sequence, in characters."})
    files: List[str] = field(
        default_factory=lambda: ["argparse.py", "dataclasses.py", "functools.py", "random.py", "textwrap.py"],
        metadata={"help": "Standard-library files (next to os.py) to learn from."},
    )
    embed: int = field(default=32, metadata={"help": "Character embedding size."})
    hidden: int = field(default=128, metadata={"help": "GRU hidden size."})
    seed: int = field(default=0, metadata={"help": "Seed for the sequence cuts, the weights and the shuffle."})
    num_workers: int = field(default=2, metadata={"help": "Ray Train workers (with --ray)."})
    threads: Optional[int] = field(
        default=None,
        metadata={
            "help": "torch CPU threads for the local run (torch.set_num_threads); null keeps torch's default. Ray workers use their CPU count."
        },
    )
    storage: str = field(default="./runs", metadata={"help": "Where Ray Train keeps the run's files (with --ray)."})


# ------------------------------------------------------------------------------ data
def load_sequences(cfg: Any) -> List[np.ndarray]:
    """Variable-length int64 arrays of ASCII codes cut from the standard library's source files."""
    root = os.path.dirname(os.__file__)
    texts = []
    for name in cfg.files:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as fh:
                texts.append(fh.read())
    if not texts:
        raise UsageError(
            f"None of files={list(cfg.files)} exist in {root}; name files like os.py or random.py from that folder."
        )
    if not 2 <= cfg.min_len <= cfg.max_len:
        raise UsageError(f"Need 2 <= min_len <= max_len, got min_len={cfg.min_len} max_len={cfg.max_len}.")
    codes = np.frombuffer("\n".join(texts).encode("ascii", errors="replace"), dtype=np.uint8).astype(np.int64)
    codes[(codes == PAD) | (codes >= VOCAB)] = ord("?")
    rng = np.random.default_rng(cfg.seed)
    sequences, start = [], 0
    while start + cfg.min_len <= len(codes):
        length = int(rng.integers(cfg.min_len, cfg.max_len + 1))
        sequences.append(codes[start : start + length])
        start += length
    return sequences


def pad_batch(sequences: Any) -> Dict[str, torch.Tensor]:
    """Pad a list of 1-D arrays into ``input`` (PAD-filled) and ``target`` (IGNORE-filled), shifted by one."""
    longest = max(len(s) for s in sequences) - 1
    inputs = torch.full((len(sequences), longest), PAD, dtype=torch.long)
    targets = torch.full((len(sequences), longest), IGNORE, dtype=torch.long)
    for row, seq in enumerate(sequences):
        seq = torch.as_tensor(np.asarray(seq, dtype=np.int64))
        inputs[row, : len(seq) - 1] = seq[:-1]
        targets[row, : len(seq) - 1] = seq[1:]
    return {"input": inputs, "target": targets}


def collate_ray(batch: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    """Ray Data hands a dict of numpy columns; ``ids`` holds one variable-length array per row."""
    return pad_batch(list(batch["ids"]))


def count_tokens(batch: Dict[str, torch.Tensor]) -> int:
    """The real characters to predict in this batch (padding does not count)."""
    return int((batch["target"] != IGNORE).sum())


# ----------------------------------------------------------------------------- model
class CharLM(torch.nn.Module):
    """Embedding -> GRU -> next-character logits, in the model protocol (forward + loss)."""

    def __init__(self, embed: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, embed, padding_idx=PAD)
        self.gru = torch.nn.GRU(embed, hidden, batch_first=True)
        self.head = torch.nn.Linear(hidden, VOCAB)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        out, _ = self.gru(self.embed(batch["input"]))
        return self.head(out)

    def loss(self, outputs: torch.Tensor, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return F.cross_entropy(outputs.flatten(0, 1), batch["target"].flatten(), ignore_index=IGNORE)


def make_model(cfg: Dict[str, Any]) -> CharLM:
    return CharLM(cfg["embed"], cfg["hidden"])


def make_optimizer(model: torch.nn.Module, cfg: Dict[str, Any]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)


def make_schedule(cfg: Dict[str, Any]) -> Any:
    try:
        from raytrain_events.schedulers import CosineAnnealingWithWarmupScheduler
    except ImportError:  # a plain function of the State works as a schedule too
        import math

        def schedule(state: Any) -> float:
            done = float(state.get_elapsed_duration())
            warm = 0.1
            return done / warm if done < warm else 0.5 * (1 + math.cos(math.pi * (done - warm) / (1 - warm)))

        return schedule
    return CosineAnnealingWithWarmupScheduler(t_warmup=cfg["warmup"])


class LossPrinter(Callback):
    """Print rank 0's mean training loss each time the global token count crosses ``every``."""

    def __init__(self, every: str) -> None:
        self.every = every
        self._due = None
        self._losses: List[float] = []
        self.points: List[tuple] = []

    def fit_start(self, state, logger) -> None:
        from raytrain_events.core.interval import make_interval

        self._due = make_interval(self.every, state.max_duration, what="log_every")

    def batch_end(self, state, logger) -> None:
        from raytrain_events import Event

        self._losses.append(float(state.loss))
        if self._due(state, Event.BATCH_END) and state.rank == 0:
            ts = state.timestamp
            loss = sum(self._losses) / len(self._losses)
            lr = state.optimizers[0].param_groups[0]["lr"]
            self.points.append((ts.token.value, loss))
            print(
                f"tok {ts.token.value:>8}  ba {ts.batch.value:>5}  ep {ts.epoch.value}  loss {loss:.3f}  lr {lr:.2e}",
                flush=True,
            )
            self._losses = []

    def fit_end(self, state, logger) -> None:
        if state.rank == 0 and len(self.points) >= 2:
            first, last = self.points[0][1], self.points[-1][1]
            print(
                f"loss fell from {first:.3f} to {last:.3f} over {state.timestamp.token.value} tokens "
                f"({state.timestamp.batch.value} batches, {state.timestamp.sample.value} sequences)",
                flush=True,
            )


def make_callbacks(cfg: Dict[str, Any]) -> List[Callback]:
    return [LossPrinter(cfg["log_every"])]


def make_worker_callbacks(cfg: Dict[str, Any]) -> List[Callback]:
    return make_callbacks(cfg)  # RayTrainer keeps Ray's own lines off the terminal (verbose=False)


# ------------------------------------------------------------------------------- run
def run_local(cfg: Dict[str, Any], sequences: List[np.ndarray]) -> None:
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    torch.manual_seed(cfg["seed"])
    loader = torch.utils.data.DataLoader(
        sequences,
        batch_size=cfg["batch_size"],
        shuffle=True,
        collate_fn=pad_batch,
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )
    model = make_model(cfg)
    optimizer = make_optimizer(model, cfg)
    state = Trainer(
        model=model,
        train_dataloader=DataSpec(loader, get_num_tokens_in_batch=count_tokens),
        max_duration=cfg["max_duration"],
        optimizers=optimizer,
        schedulers=make_schedule(cfg),
        callbacks=make_callbacks(cfg),
        seed=cfg["seed"],
    ).fit()
    print(
        f"final timestamp: {state.timestamp.token.value} tokens, {state.timestamp.sample.value} samples, "
        f"{state.timestamp.batch.value} batches, {state.timestamp.epoch.value} epochs"
    )


def run_ray(cfg: Dict[str, Any], sequences: List[np.ndarray]) -> None:
    import ray.data

    from raytrain_events import RayTrainer

    trainer = RayTrainer(
        model=make_model,
        optimizers=make_optimizer,
        schedulers=lambda optimizers, config: make_schedule(config),
        callbacks=make_worker_callbacks,
        datasets={"train": ray.data.from_items([{"ids": s} for s in sequences])},
        collate_fn=collate_ray,
        get_num_tokens_in_batch=count_tokens,
        max_duration=cfg["max_duration"],
        batch_size=cfg["batch_size"],
        num_workers=cfg["num_workers"],
        storage_path=cfg["storage"],
        report_interval=cfg["log_every"],
        config=cfg,
        progress_bar=True,
    )
    result = trainer.fit()
    losses = [(e["time/token"], e["train/loss"]) for e in result.history if "train/loss" in e]
    print("\nglobal loss by tokens (mean over all workers):")
    for tokens, loss in losses:
        print(f"  tok {tokens:>8}  loss {loss:.3f}")
    print(
        f"final timestamp: {result.timestamp.token.value} tokens, {result.timestamp.sample.value} samples, "
        f"{result.timestamp.batch.value} batches, {result.timestamp.epoch.value} epochs"
    )


def main(argv: List[str]) -> int:
    parser = ArgumentParser(
        prog="train_tokens.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (set them as key=value; durations are Time strings like 2e5tok, 300ba, 0.1dur):\n"
        + keys_help(TokensConfig),
    )
    parser.add_argument(
        "--ray",
        action="store_true",
        help="Train on Ray Train workers (RayTrainer) instead of in this process (Trainer).",
    )
    parser.add_argument(
        "--config", metavar="PATH", help="YAML file with any of the config keys below (overrides win over it)."
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="Config overrides, like max_duration=5e5tok lr=1e-3."
    )
    args = parser.parse_args(argv)

    def run() -> int:
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(load_config(TokensConfig, config_path=args.config, overrides=args.overrides))
        sequences = load_sequences(OmegaConf.create(cfg))
        lengths = [len(s) for s in sequences]
        print(
            f"{len(sequences)} sequences of {min(lengths)}..{max(lengths)} characters ({sum(lengths) - len(lengths)} tokens per epoch); "
            f"training for {cfg['max_duration']} {'on Ray' if args.ray else 'locally'}",
            flush=True,
        )
        (run_ray if args.ray else run_local)(cfg, sequences)
        return 0

    return run_guarded(run, prog="train_tokens.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
