"""``--data package.module:function``: the user's own dataset, the twin of ``--model``.

The contract (README, "Your own data"):

* The function is called once per split, with the keyword arguments it accepts of
  ``split="train"`` / ``split="test"`` and ``framework="torch"`` / ``"tf"``.
* It returns a map-style dataset: ``len(ds)`` and ``ds[i] -> (image, label)`` for every ``i`` in
  ``range(len(ds))``; a ``torch.utils.data.Dataset`` (torchvision's datasets included) is one.
  PyTorch wants the image as a float tensor ``[channels, height, width]``, TensorFlow as an array
  ``[height, width, channels]``, both normalised as the model expects them (ringtrain does not
  normalise your data); the label is an int in ``range(num_classes)``.
* The class count comes from the training split's ``classes`` (names, as torchvision's datasets
  have), else its ``num_classes``, else its ``targets`` (all labels, as torchvision's datasets
  have); without any of them it is one line asking for ``classes``.

Random access is what the sharding needs: every epoch each rank reads ``perm[r::N]`` of the same
permutation, an elastic job re-shards the rest of an epoch, and ``--resume`` starts an epoch
afresh, all without holding the data.  Checked at start-up on every rank (the first item of each
split, the class count), each problem one line.
"""

from __future__ import annotations

from typing import Any

from ringtrain import user_code
from ringtrain.errors import UserError

SPLITS = ("train", "test")


def call(spec: str, split: str, framework: str) -> Any:
    function = user_code.import_function("--data", spec, "returns a dataset")
    ds = user_code.call("--data", spec, function, {"split": split, "framework": framework})
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise UserError(f"--data {spec} returned a {type(ds).__module__}.{type(ds).__qualname__} for "
                        f"split={split!r}, not a map-style dataset (len(ds) and ds[i] -> (image, "
                        f"label)); see README, 'Your own data'")
    try:
        size = len(ds)
    except Exception as err:
        raise UserError(f"--data {spec}: len() of its {split} split failed: {type(err).__name__}: "
                        f"{user_code.one_line(err)}") from None
    if size < 1:
        raise UserError(f"--data {spec}: its {split} split is empty")
    return ds


def first_item(spec: str, split: str, ds: Any) -> tuple[Any, int]:
    """``ds[0]`` as ``(image, label)``, or one line saying what it is instead."""
    try:
        item = ds[0]
    except Exception as err:
        raise UserError(f"--data {spec}: reading item 0 of its {split} split failed: "
                        f"{type(err).__name__}: {user_code.one_line(err)}") from None
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise UserError(f"--data {spec}: item 0 of its {split} split is a {type(item).__name__}, "
                        f"not an (image, label) pair")
    image, label = item
    try:
        label = int(label)
    except (TypeError, ValueError):
        raise UserError(f"--data {spec}: the label of item 0 of its {split} split is a "
                        f"{type(label).__name__}, not an int class index") from None
    return image, label


def classes(spec: str, train: Any) -> tuple[int, tuple[str, ...] | None]:
    """``(num_classes, class names or None)`` of the training split."""
    names = getattr(train, "classes", None)
    if names is not None:
        names = tuple(str(n) for n in names)
        return len(names), names
    count = getattr(train, "num_classes", None)
    if count is None and getattr(train, "targets", None) is not None:
        count = int(max(int(t) for t in train.targets)) + 1
    if count is None:
        raise UserError(f"--data {spec}: say how many classes there are: give the training split a "
                        f"'classes' attribute (the class names) or 'num_classes'")
    if int(count) < 2:
        raise UserError(f"--data {spec}: {count} class(es); classification needs at least two")
    return int(count), None


def sizes(args, spec: str, train: Any, test: Any) -> tuple[int, int]:
    """Images trained and evaluated on: all, or ``--train-samples`` / ``--test-samples`` of them
    (:func:`ringtrain.data.sharding.fixed_sample` picks which)."""
    if args.train_samples is not None and args.train_samples > len(train):
        raise UserError(f"--train-samples {args.train_samples} is more than the {len(train)} "
                        f"training items of --data {spec}; lower it or drop it")
    return (min(args.train_samples or len(train), len(train)),
            min(args.test_samples or len(test), len(test)))
