"""One image file to pixels, the same way in both frameworks: PIL decodes, converts to the dataset's
channels and resizes, so a PyTorch and a TensorFlow run of the same folder see the same pixels
(torchvision's ``ImageFolder`` reads with PIL too).  Anything that goes wrong is an
:class:`ImageError` naming the file.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image, UnidentifiedImageError

SUFFIXES = (".jpg", ".jpeg", ".png")  # what an image folder may hold (any case)
MODES = {1: "L", 3: "RGB"}  # channels -> PIL mode


class ImageError(Exception):
    """A file that is not a readable JPEG or PNG image."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


def is_image_name(name: str) -> bool:
    return name.lower().endswith(SUFFIXES)


def probe(path: str | os.PathLike) -> tuple[int, int, int]:
    """(height, width, channels) of an image: 1 channel for grayscale, 3 for everything else."""
    try:
        with Image.open(path) as im:
            width, height = im.size
            gray = im.mode in ("L", "LA", "I", "I;16", "1")
    except (OSError, UnidentifiedImageError, ValueError) as err:
        raise ImageError(path, _reason(err)) from None
    return height, width, 1 if gray else 3


def load(path: str | os.PathLike, shape: tuple[int, int, int]) -> np.ndarray:
    """The image as uint8 ``[height, width, channels]`` of ``shape``: converted to grayscale or
    RGB, resized (bilinear, PIL's antialiasing) when its size differs."""
    height, width, channels = shape
    try:
        with Image.open(path) as im:
            im = im.convert(MODES[channels])
            if im.size != (width, height):
                im = im.resize((width, height), Image.BILINEAR)
            pixels = np.asarray(im, dtype=np.uint8)
    except (OSError, UnidentifiedImageError, ValueError, SyntaxError) as err:
        raise ImageError(path, _reason(err)) from None
    return pixels.reshape(height, width, channels)


def _reason(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text if len(text) <= 160 else text[:157] + "..."
