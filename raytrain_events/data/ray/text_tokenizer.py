"""`TextTokenizer`: the tokenizer `tokenize` encodes with, from a file, a folder or a name, never the network.

``tokenizer=`` of `tokenize` / ``raytrain-events tokenize --tokenizer`` is one of:

* a ``tokenizer.json`` file (Hugging Face ``tokenizers``' ``Tokenizer.save``): loaded with
  ``tokenizers`` (the ``[text]`` extra), its Rust encoder batching the texts;
* a folder a ``transformers`` tokenizer was saved to (``save_pretrained``: a model folder holds
  one), or the name of one already in the local Hugging Face cache: loaded with
  ``transformers.AutoTokenizer.from_pretrained(..., local_files_only=True)`` (the ``[hf]`` extra),
  so any tokenizer ``transformers`` can load, fast or not, and nothing is downloaded.

Each gives the same three things: ``encode_batch(texts)`` (token ids per text, no special tokens
added), ``vocab_size`` (every id it can produce, added tokens included: what the model's
embedding must hold, written to each shard's footer and checked by ``PackedTokens(vocab_size=)``)
and ``fingerprint`` (SHA-256 of the tokenizer file, or of every file of the folder in name order:
a shard records it, so a rerun with another tokenizer is refused rather than mixed in). A path
that is neither a file nor a folder, and a name not in the local cache, is refused naming the fix.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Iterator, List, Optional

__all__ = ["TextTokenizer", "load_tokenizer"]


class TextTokenizer:
    """A loaded tokenizer: ``encode_batch``, ``vocab_size``, ``token_id``, ``fingerprint`` (module doc)."""

    def __init__(self, spec: str, impl: Any, kind: str, fingerprint: str) -> None:
        self.spec, self.impl, self.kind, self.fingerprint = spec, impl, kind, fingerprint

    @property
    def vocab_size(self) -> int:
        if self.kind == "tokenizers":
            return int(self.impl.get_vocab_size(with_added_tokens=True))
        return len(self.impl)  # transformers: the base vocabulary and the added tokens

    def token_id(self, token: str) -> Optional[int]:
        """The id of ``token`` (a whole token of the vocabulary), or None."""
        if self.kind == "tokenizers":
            found = self.impl.token_to_id(token)
            return None if found is None else int(found)
        found = self.impl.get_vocab().get(token)
        return None if found is None else int(found)

    def encode_batch(self, texts: List[str]) -> List[List[int]]:
        if self.kind == "tokenizers":
            return [e.ids for e in self.impl.encode_batch(texts, add_special_tokens=False)]
        # verbose=False: no warning per document longer than the model's context (packing cuts them)
        return list(self.impl(texts, add_special_tokens=False, verbose=False)["input_ids"])


def _sha256_files(paths: List[str]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        digest.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            digest.update(f.read())
    return digest.hexdigest()


def _folder_files(folder: str) -> List[str]:
    return sorted(
        os.path.join(folder, name)
        for name in os.listdir(folder)
        if os.path.isfile(os.path.join(folder, name)) and not name.startswith(".")
    )


def load_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer ``spec`` names (module doc); refuses, naming the fix, one it cannot load offline."""
    if os.path.isfile(spec):
        from tokenizers import Tokenizer  # deferred: an optional dependency (pip install raytrain_events[text])

        try:
            impl = Tokenizer.from_file(spec)
        except Exception as exc:
            raise ValueError(
                f"{spec!r} is not a tokenizers tokenizer.json ({type(exc).__name__}: {exc}). Give a tokenizer.json "
                "(tokenizers' Tokenizer.save) or the folder a transformers tokenizer was saved to."
            ) from None
        return TextTokenizer(spec, impl, "tokenizers", _sha256_files([spec]))
    # A Hugging Face name is "name" or "org/name"; a path starts at the root, home or "." (or is a .json file).
    looks_like_path = spec.endswith(".json") or spec.startswith((os.sep, ".", "~")) or spec.count("/") > 1
    if not os.path.isdir(spec) and looks_like_path:
        raise FileNotFoundError(
            f"The tokenizer file or folder {spec!r} does not exist. Give the path of a tokenizer.json (tokenizers' "
            "Tokenizer.save), a folder a transformers tokenizer was saved to (save_pretrained), or the name of "
            "one in the local Hugging Face cache; nothing is downloaded."
        )
    try:
        from transformers import AutoTokenizer  # deferred: heavy and optional (pip install raytrain_events[hf])
    except ImportError:
        raise ImportError(
            f"The tokenizer {spec!r} is a folder or a name: loading it needs transformers (pip install "
            "'raytrain_events[hf]'), or give a tokenizer.json file (tokenizers)."
        ) from None
    try:
        with _offline():
            impl = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except (OSError, ValueError) as exc:
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if os.path.isdir(spec):
            raise FileNotFoundError(
                f"transformers could not load the tokenizer folder {spec!r} ({why}). Fix: the folder a tokenizer was "
                "saved to (tokenizer.save_pretrained(folder): tokenizer_config.json and its vocabulary files), or a "
                "tokenizer.json file; nothing is downloaded."
            ) from None
        raise FileNotFoundError(
            f"The tokenizer {spec!r} is no file or folder here, and transformers could not load it by that name from "
            f"the local Hugging Face cache ({why}). Fix: a path that exists, or save it to a folder first "
            "(AutoTokenizer.from_pretrained(name).save_pretrained(folder) where the network is reachable) and pass "
            "the folder; nothing is downloaded."
        ) from None
    folder = spec if os.path.isdir(spec) else _cached_folder(spec)
    return TextTokenizer(spec, impl, "transformers", _sha256_files(_folder_files(folder)))


def _cached_folder(name: str) -> str:
    """The local Hugging Face cache's folder of ``name`` (transformers loaded it from there)."""
    from huggingface_hub import snapshot_download

    with _offline():
        return str(snapshot_download(name, local_files_only=True))


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Hugging Face Hub's offline mode (``HF_HUB_OFFLINE``) for the load: ``local_files_only`` alone
    still lets huggingface_hub fetch its agent registry from the Hub when it builds a request's headers."""
    from huggingface_hub import constants

    was, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = was
