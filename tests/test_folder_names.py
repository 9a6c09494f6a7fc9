"""An image folder's file and class names may be anything the file system holds: accents, other
scripts, even bytes that are not UTF-8.  The index keeps them as the file system's bytes and reads
every image back, with its class."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from image_folders import shapes_folder

from ringtrain.data import folder, images


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a name that is not UTF-8 needs Linux")
def test_names_beyond_ascii_are_indexed_and_read(tmp_path):
    root = shapes_folder(tmp_path / "f", 6, 3, size=16, classes=("circle", "square"))
    train = root / "train"
    (train / "square").rename(train / "carré")  # a class name with an accent
    (root / "test" / "square").rename(root / "test" / "carré")
    renames = {train / "circle" / "000000.jpg": train / "circle" / "café.jpg",
               train / "circle" / "000002.jpg": train / "circle" / "猫.jpg",
               train / "circle" / "000004.jpg": train / "circle" / os.fsdecode(b"bad-\xff.jpg")}
    for old, new in renames.items():
        shutil.move(old, new)

    index = folder.scan(str(root))
    assert index.classes == ("carré", "circle")
    names = [index.train.path(i) for i in range(len(index.train.labels))]
    assert {Path(p) for p in names} == {p for p in train.rglob("*.jpg")}
    for i, path in enumerate(names):
        assert index.train.labels[i] == index.classes.index(Path(path).parent.name)
        assert images.load(path, index.shape).shape == (16, 16, 3)
    assert np.all(index.train.labels[:3] == 0) and np.all(index.train.labels[3:] == 1)
