"""``--data package.module:function``: the user's own dataset, the twin of ``--model``.

The contract (README, "Your own data"):

* The function is called once per split, with the keyword arguments it accepts of
  ``split="train"`` / ``split="test"`` and ``framework="torch"`` / ``"tf"``.
* It returns a map-style dataset: ``len(ds)`` and ``ds[i] -> (input, label)`` for every ``i`` in
  ``range(len(ds))``; a ``torch.utils.data.Dataset`` (torchvision's datasets included) is one.
  The input is a tensor or array of any shape, the same for every item: float features (a
  signal, a table's row, an image), which train as float32, or integer token ids, which train as
  int64 (uint8 counts as pixels: float32).  A float input of three dimensions is an image, laid
  out as the framework lays images out (PyTorch ``[channels, height, width]``, TensorFlow
  ``[height, width, channels]``), which is what the built-in CNN reads; the built-in MLP reads
  any float input; anything else needs your own ``--model``.  Inputs arrive as the model expects
  them (ringtrain does not normalise your data); the label is an int in ``range(num_classes)``.
* The class count comes from the training split's ``classes`` (names, as torchvision's datasets
  have), else its ``num_classes``, else its ``targets`` (all labels, as torchvision's datasets
  have); without any of them it is one line asking for ``classes``.

Every item is checked as it is read: one of another shape or kind, or with a label out of range,
is a data problem like an image that does not decode, which ends every rank at the step that
met it with one line naming the item (:mod:`ringtrain.training.divergence`).

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
    """``ds[0]`` as ``(input, label)``, or one line saying what it is instead."""
    try:
        item = ds[0]
    except Exception as err:
        raise UserError(f"--data {spec}: reading item 0 of its {split} split failed: "
                        f"{type(err).__name__}: {user_code.one_line(err)}") from None
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise UserError(f"--data {spec}: item 0 of its {split} split is a {type(item).__name__}, "
                        f"not an (input, label) pair")
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


# --- the inputs: any shape, float features or integer token ids ---------------------------------

FLOAT, IDS = "float32", "int64"  # what an input trains as


def input_dtype(kind: str, itemsize: int) -> str | None:
    """What an input of numpy dtype kind ``kind`` trains as: float (``f``) and uint8 pixels as
    float32, other integers (token ids) as int64; None for anything else (bool, complex, text)."""
    if kind == "f" or (kind == "u" and itemsize == 1):
        return FLOAT
    if kind in "iu":
        return IDS
    return None


def describe(shape: tuple[int, ...], dtype: Any) -> str:
    return f"a {tuple(shape)} {str(dtype).removeprefix('torch.')} tensor"


def input_problem(spec: str, split: str, framework: str, shape: tuple[int, ...] | None,
                  dtype: Any, kind: str | None) -> str | None:
    """Why item 0's input cannot train (``shape`` None: it is no tensor or array of numbers)."""
    if shape is None:
        return (f"--data {spec}: the input of item 0 of its {split} split is {dtype}; --framework "
                f"{framework} needs a tensor or array of numbers"
                + (" (e.g. a torchvision transform ending in ToTensor())" if framework == "torch"
                   else ""))
    if kind is None:
        return (f"--data {spec}: the input of item 0 of its {split} split is "
                f"{describe(shape, dtype)}; inputs must be float features or integer token ids")
    if not shape:
        return (f"--data {spec}: the input of item 0 of its {split} split is a scalar; give each "
                f"example's features as an array of at least one dimension (e.g. [1])")
    return None


def same_inputs(spec: str, train: tuple[tuple[int, ...], str], test: tuple[tuple[int, ...], str]) -> None:
    """Both splits' first inputs have one shape and one kind: one model reads both."""
    if train != test:
        raise UserError(f"--data {spec}: its train inputs are {train[1]} {train[0]}, its test inputs "
                        f"{test[1]} {test[0]}; give both splits the same shape and kind")


def item_problem(spec: str, split: str, i: int, shape: tuple[int, ...], kind: str | None,
                 label: Any, want_shape: tuple[int, ...], want_kind: str, num_classes: int) -> str | None:
    """Why item ``i`` cannot train beside item 0 (another shape or kind of input, a label that is
    not a class index), or None."""
    where = f"item {i} of --data {spec}'s {split} split"
    if tuple(shape) != tuple(want_shape) or kind != want_kind:
        return (f"{where} has a {kind or 'non-numeric'} input of shape {tuple(shape)}, item 0 a "
                f"{want_kind} one of shape {tuple(want_shape)}")
    try:
        value = int(label)
    except (TypeError, ValueError):
        return f"{where} has a label of type {type(label).__name__}, not an int class index"
    if not 0 <= value < num_classes:
        return f"{where} has label {value}, outside range({num_classes}) of its {num_classes} classes"
    return None
