"""Checks on the run report's PNGs: a real image, of the size the figure's panels give, not blank."""

from __future__ import annotations


def check_png(path: str, panels: int = 1, size=None) -> None:
    """``path`` is a PNG of ``size`` (default: a grid of ``panels`` panels) that is not blank."""
    import numpy as np
    from PIL import Image

    from raytrain_events.report.plots import grid_size

    with open(path, "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    image = Image.open(path)
    expected = size or grid_size(panels)
    assert image.size == expected, (path, image.size, expected)
    pixels = np.asarray(image.convert("L"), dtype=np.float32)
    # Not blank: lines and text make a sizeable share of pixels differ from the background.
    background = np.median(pixels)
    assert (np.abs(pixels - background) > 40).mean() > 0.01, f"{path} looks blank"
