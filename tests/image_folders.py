"""Image folders for tests and benchmarks, written on the spot (no image is committed).

* :func:`mnist_folder`: MNIST's own images as PNG files, ``train/<digit>/*.png``: the same pixels
  as ``--data mnist``, read the way a user's folder is.
* :func:`shapes_folder`: real pictures, not noise: a filled circle, square or triangle (one class
  per shape) of random size, position and colour on a random background, as JPEG or PNG, RGB or
  grayscale: learnable to high accuracy in an epoch or two, at any size.  ``distinct=K`` draws
  K pictures and writes them in turn, for folders of hundreds of thousands of files (the
  ``data`` benchmark's 200,000: the files are what is measured, and encoding each one anew
  would take most of the time).
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SHAPES = ("circle", "square", "triangle")


def mnist_folder(root: Path, n_train: int, n_test: int, mnist_dir: str | None = None) -> Path:
    """MNIST's first ``n_train`` training and ``n_test`` test images as PNG files."""
    from ringtrain.data import mnist

    data = mnist.load(mnist_dir, download=False)
    for split, images, labels, n in (("train", data.train_images, data.train_labels, n_train),
                                     ("test", data.test_images, data.test_labels, n_test)):
        for i in range(n):
            folder = root / split / str(labels[i])
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(images[i], mode="L").save(folder / f"{i:05d}.png")
    return root


def shape_image(rng: np.random.Generator, shape: str, size: int, mode: str) -> Image.Image:
    background = tuple(int(v) for v in rng.integers(0, 100, 3))
    colour = tuple(int(v) for v in rng.integers(140, 256, 3))
    im = Image.new("RGB", (size, size), background)
    draw = ImageDraw.Draw(im)
    r = rng.uniform(0.2, 0.4) * size
    cx, cy = rng.uniform(r, size - r, 2)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=colour)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=colour)
    else:
        draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=colour)
    return im.convert(mode)


def shapes_folder(root: Path, n_train: int, n_test: int, size: int = 32, mode: str = "RGB",
                  fmt: str = "jpg", seed: int = 0, classes: tuple[str, ...] = SHAPES,
                  sizes: tuple[int, ...] | None = None, distinct: int | None = None) -> Path:
    """``n_train`` / ``n_test`` images per split, classes in turn.  ``sizes`` mixes image sizes
    (the trainer resizes them to the first one's, or to --image-size).  ``distinct``: draw only
    that many pictures per split (rounded up to a multiple of the class count) and write them in
    turn, each file still in its own class's folder."""
    rng = np.random.default_rng(seed)
    if distinct is not None:
        distinct = -(-distinct // len(classes)) * len(classes)
    for split, n in (("train", n_train), ("test", n_test)):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
        pool: list[bytes] = []
        for i in range(n):
            name = classes[i % len(classes)]
            path = root / split / name / f"{i:06d}.{fmt}"
            if distinct is not None and i >= distinct:
                path.write_bytes(pool[i % distinct])
                continue
            side = sizes[i % len(sizes)] if sizes else size
            im = shape_image(rng, SHAPES[classes.index(name) % len(SHAPES)], side, mode)
            buf = io.BytesIO()
            im.save(buf, format="JPEG", quality=90) if fmt == "jpg" else im.save(buf, format=fmt.upper())
            path.write_bytes(buf.getvalue())
            if distinct is not None:
                pool.append(buf.getvalue())
    return root


def corrupt(path: str | os.PathLike) -> None:
    """Cut a file to its first bytes: a header, no image."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:64])
