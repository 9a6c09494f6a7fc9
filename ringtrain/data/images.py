"""One image file to pixels, the same way in both frameworks: PIL decodes, converts to the dataset's
channels and resizes, so a PyTorch and a TensorFlow run of the same folder see the same pixels
(torchvision's ``ImageFolder`` reads with PIL too).  Anything that goes wrong is an
:class:`ImageError` naming the file.

Only JPEG and PNG are decoded, whatever the name says (PIL would otherwise read a BMP or TIFF
named ``.png``, and hand an EPS to Ghostscript where it is installed), and only images of at most
``max_pixels`` pixels (``--max-image-pixels``): the size is read from the header, before any
pixel is decoded.  PIL's own decompression-bomb warning is an error in a process that imports this
module, so a file past PIL's limit is one :class:`ImageError` too, never a warning line.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
from PIL import Image

from ringtrain.errors import printable

SUFFIXES = (".jpg", ".jpeg", ".png")  # what an image folder may hold (any case)
FORMATS = ("JPEG", "PNG")  # what PIL may decode them as
MODES = {1: "L", 3: "RGB"}  # channels -> PIL mode
# --max-image-pixels' default: a 24-megapixel camera's 6000 x 4000 fits; PIL's own limit is
# 89.5 megapixels (a warning), 179 (an error).  A 100-megapixel PNG decoded whole took 96 MB
# more than the index, and as the first image made the model's input 10000 x 10000.
MAX_PIXELS = 25_000_000

warnings.simplefilter("error", Image.DecompressionBombWarning)


class ImageError(Exception):
    """A file that is not a readable JPEG or PNG image."""

    def __init__(self, path: str | os.PathLike, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = str(path), reason


def is_image_name(name: str) -> bool:
    return name.lower().endswith(SUFFIXES)


def _open(path: str | os.PathLike, max_pixels: int) -> Image.Image:
    """The image opened (its header read, no pixel decoded), if it is a JPEG or PNG of at most
    ``max_pixels`` pixels."""
    if Image.MAX_IMAGE_PIXELS is not None and max_pixels > Image.MAX_IMAGE_PIXELS:
        Image.MAX_IMAGE_PIXELS = max_pixels  # the user raised --max-image-pixels past PIL's limit
    im = Image.open(path, formats=FORMATS)
    width, height = im.size
    if width * height > max_pixels:
        im.close()
        raise ImageError(path, f"{width} x {height} pixels, more than --max-image-pixels "
                               f"{max_pixels} (raise it to read such images)")
    return im


def probe(path: str | os.PathLike, max_pixels: int = MAX_PIXELS) -> tuple[int, int, int]:
    """(height, width, channels) of an image: 1 channel for grayscale, 3 for everything else."""
    try:
        with _open(path, max_pixels) as im:
            width, height = im.size
            gray = im.mode in ("L", "LA", "I", "I;16", "1")
    except ImageError:
        raise
    except Exception as err:  # PIL raises many types for malformed files (OSError, SyntaxError,
        # ValueError, its bomb error and warning, struct.error from EXIF...)
        raise ImageError(path, _reason(err)) from None
    return height, width, 1 if gray else 3


def load(path: str | os.PathLike, shape: tuple[int, int, int],
         max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """The image as uint8 ``[height, width, channels]`` of ``shape``: converted to grayscale or
    RGB, resized (bilinear, PIL's antialiasing) when its size differs."""
    height, width, channels = shape
    try:
        with _open(path, max_pixels) as im:
            im = im.convert(MODES[channels])
            if im.size != (width, height):
                im = im.resize((width, height), Image.BILINEAR)
            pixels = np.asarray(im, dtype=np.uint8)
    except ImageError:
        raise
    except Exception as err:  # as in probe
        raise ImageError(path, _reason(err)) from None
    return pixels.reshape(height, width, channels)


def _reason(err: BaseException) -> str:
    return printable(str(err) or type(err).__name__)
