"""`Location`: a URL resolved once into its filesystem and path, then passed down instead of the URL.

``resolve(url, storage_options)`` turns a URL into ``(fs, path)``; code that kept the URL and
resolved it again at each step (the checkpoint writer did, four times per save) repeats that work
and can disagree with itself on what the URL means. A `Location` is the answer, kept: build it
where the URL enters (`Location.of`), pass it down, and take children with `Location.child`, which
joins on the same filesystem without resolving again.

Usage::

    where = Location.of("s3://bucket/run/checkpoints/ckpt-1", storage_options={"anon": False})
    write_bytes_atomic(where.fs, where.child("x.json").path, b"{}")
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raytrain_events.storage.fs import basename, join, resolve, to_url

__all__ = ["Location"]


@dataclasses.dataclass(frozen=True)
class Location:
    """A URL with its filesystem and the path on it (``fs``/``path`` as `resolve` gives them).

    ``url`` is the full URL of ``path`` on ``fs`` (`to_url`: a local path stays a path), the form
    that is written into manifests and handed to other processes. Two locations are equal when
    their URLs are."""

    url: str
    fs: Any = dataclasses.field(repr=False, compare=False)
    path: str = dataclasses.field(compare=False)

    @classmethod
    def of(cls, where: str | Location, storage_options: dict[str, Any] | None = None) -> Location:
        """``where`` resolved (a `Location` is returned as it is: it was resolved already)."""
        if isinstance(where, Location):
            return where
        fs, path = resolve(where, storage_options)
        return cls(to_url(fs, path), fs, path)

    def child(self, *parts: str) -> Location:
        """The location of ``parts`` joined under this one, on the same filesystem (nothing resolved)."""
        path = join(self.path, *parts)
        return Location(to_url(self.fs, path), self.fs, path)

    @property
    def name(self) -> str:
        """The last piece of the path (a checkpoint directory's name, a file's name)."""
        return basename(self.path)
