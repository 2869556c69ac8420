"""Images for `fedsaddle data split`: an array file, or a folder of one subfolder per class.

Three sources, each read into the split's `Table` (experiments/datasets.py):

* a `.npy` file of images, shape (N, C, H, W) (or (N, H, W): one channel), with
  the labels in a second `.npy` file (`--labels`), one per image;
* a `.npz` file holding the images under `images` or `X` and the labels under
  `labels` or `y`;
* a folder with one subfolder per class, named after it, each holding that
  class's images: PNG, JPEG, BMP or GIF files (read with Pillow, in the `data`
  extra; (H, W) or (H, W, C) as the file holds them) or `.npy` arrays of one
  image each, (H, W) or (C, H, W).

Every image must have the same shape. Pixels of integer type (uint8, as image
files hold) are divided by 255; floating pixels are taken as they are. A class
is a distinct label (in sorted order; a folder's classes are its subfolders, in
sorted order), written as its index 0..K-1; `positive` makes the task binary,
one class (its label, or its folder's name) against the rest, as 1 and 0.

The rows of the table are the images flattened in C order (channel, then row,
then column), so that every client file is an ordinary one (X: rows x features,
common/problems/data.py) and the split's summary records the shape
(`image_shape`: [C, H, W]) a problem needs to see images again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from fedsaddle.common.numeric import Array

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
ARRAY_SUFFIXES = (".npy", ".npz")
_IMAGE_KEYS, _LABEL_KEYS = ("images", "X"), ("labels", "y")


class ImageError(ValueError):
    """Images that cannot be split; the message names the file and the fault."""


def is_image_source(path: str | Path) -> bool:
    """Whether `data split`'s FILE names images: an array file, or a folder."""
    path = Path(path)
    return path.suffix.lower() in ARRAY_SUFFIXES or path.is_dir()


class Images:
    """Images as the split takes them: rows (N, C*H*W), labels, the class names, the image shape."""

    def __init__(self, pixels: NDArray[Any], labels: NDArray[Any], names: tuple[str, ...], source: str) -> None:
        self.source = source
        channels, height, width = pixels.shape[1:]
        self.shape = (int(channels), int(height), int(width))
        self.rows: Array = _scaled(pixels, source).reshape(len(pixels), -1)
        self.labels = labels  # class indices 0..K-1
        self.names = names  # each class's label (or folder name), by index


def load_images(path: str | Path, labels: str | Path | None = None) -> Images:
    """The images at `path` (see the module's docstring); ImageError naming the fault."""
    path = Path(path)
    if path.is_dir():
        if labels is not None:
            raise ImageError(f"{path}: a folder's labels are its subfolders; --labels is for a .npy of images")
        return _folder(path)
    if not path.exists():
        raise ImageError(f"{path}: no such file or folder")
    suffix = path.suffix.lower()
    if suffix == ".npz":
        if labels is not None:
            raise ImageError(f"{path}: a .npz holds its labels ({' or '.join(_LABEL_KEYS)}); --labels is for a .npy")
        arrays = _npz(path)
        pixels, values = _pick(path, arrays, _IMAGE_KEYS, "images"), _pick(path, arrays, _LABEL_KEYS, "labels")
    elif suffix == ".npy":
        if labels is None:
            raise ImageError(f"{path}: give the images' labels with --labels FILE.npy (one label per image)")
        pixels, values = _npy(path), _npy(Path(labels))
    else:
        raise ImageError(f"{path}: images come as .npy, .npz or a folder of class subfolders, not {suffix!r}")
    pixels = _channels_first(path, pixels)
    if values.ndim != 1 or len(values) != len(pixels):
        raise ImageError(f"{path}: {len(pixels)} images but labels of shape {values.shape} (expected ({len(pixels)},))")
    if values.dtype.kind not in "iub" and not (values.dtype.kind == "f" and np.all(values == np.round(values))):
        raise ImageError(f"{path}: the labels must be whole numbers (classes), got {values.dtype} values")
    classes, indices = np.unique(values.astype(np.int64), return_inverse=True)
    return Images(pixels, indices, tuple(str(c) for c in classes), str(path))


def binary(images: Images, positive: str) -> tuple[Array, dict[str, int]]:
    """Labels 1 for the class `positive` (its label or folder name), 0 for the rest, and the codes written."""
    if positive not in images.names:
        raise ImageError(
            f"{images.source}: --positive {positive!r} is no class of it; its classes: {list(images.names)}"
        )
    chosen = images.names.index(positive)
    return (images.labels == chosen).astype(np.float64), {positive: 1, "the other classes": 0}


def _scaled(pixels: NDArray[Any], source: str) -> Array:
    if pixels.dtype.kind in "iub":
        return pixels.astype(np.float64) / 255.0
    if pixels.dtype.kind != "f":
        raise ImageError(f"{source}: pixels of type {pixels.dtype} are not numbers")
    values = pixels.astype(np.float64)
    if not np.isfinite(values).all():
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
        raise ImageError(f"{source}: pixel {list(where)} is {values[where]} (NaN and Inf are refused)")
    return values


def _channels_first(path: Path, pixels: NDArray[Any]) -> NDArray[Any]:
    if pixels.ndim == 3:
        return pixels[:, None]  # one channel
    if pixels.ndim != 4:
        raise ImageError(f"{path}: images of shape {pixels.shape}; expected (N, C, H, W) or (N, H, W)")
    if len(pixels) == 0:
        raise ImageError(f"{path}: no images")
    return pixels


def _npy(path: Path) -> NDArray[Any]:
    try:
        return np.load(path, allow_pickle=False)  # type: ignore[no-any-return]
    except FileNotFoundError:
        raise ImageError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ImageError(f"{path}: not a readable .npy file ({exc})") from None


def _npz(path: Path) -> dict[str, NDArray[Any]]:
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError) as exc:
        raise ImageError(f"{path}: not a readable .npz file ({exc})") from None


def _pick(path: Path, arrays: dict[str, NDArray[Any]], keys: tuple[str, ...], what: str) -> NDArray[Any]:
    found = [key for key in keys if key in arrays]
    if len(found) != 1:
        got = "both" if found else "neither"
        raise ImageError(
            f"{path}: its {what} go under {' or '.join(keys)}, and it has {got} (arrays {sorted(arrays)[:10]})"
        )
    return arrays[found[0]]


def _folder(path: Path) -> Images:
    classes = sorted(child for child in path.iterdir() if child.is_dir())
    if len(classes) < 2:
        raise ImageError(
            f"{path}: {len(classes)} subfolder(s); a folder of images has one subfolder per class (two or more)"
        )
    pixels: list[NDArray[Any]] = []
    labels: list[int] = []
    shape: tuple[int, ...] | None = None
    first = ""
    for index, folder in enumerate(classes):
        files = sorted(f for f in folder.iterdir() if f.suffix.lower() in (*IMAGE_SUFFIXES, ".npy"))
        if not files:
            raise ImageError(f"{folder}: no images (PNG, JPEG, BMP, GIF or .npy) in class {folder.name!r}")
        for file in files:
            image = _channels_first_one(file, _npy(file) if file.suffix.lower() == ".npy" else _picture(file))
            if shape is None:
                shape, first = image.shape, str(file)
            elif image.shape != shape:
                raise ImageError(
                    f"{file}: an image of shape {image.shape}, but {first} has {shape}: every image needs one shape"
                )
            pixels.append(image)
            labels.append(index)
    dtypes = {p.dtype for p in pixels}
    stacked = np.stack(pixels) if len(dtypes) == 1 else np.stack([p.astype(np.float64) for p in pixels])
    return Images(stacked, np.array(labels), tuple(c.name for c in classes), str(path))


def _picture(file: Path) -> NDArray[Any]:
    try:
        from PIL import Image
    except ImportError:
        raise ImageError(f"{file}: reading image files needs Pillow: pip install 'fedsaddle[data]'") from None
    try:
        with Image.open(file) as opened:
            picture = opened if opened.mode in ("L", "RGB", "RGBA") else opened.convert("RGB")  # (palette, ...)
            return np.asarray(picture)
    except OSError as exc:
        raise ImageError(f"{file}: not a readable image ({exc})") from None


def _channels_first_one(file: Path, image: NDArray[Any]) -> NDArray[Any]:
    """One image as (C, H, W): (H, W) is one channel; an image file's (H, W, C) is moved to (C, H, W); a
    .npy of three axes is (C, H, W) already."""
    if image.ndim == 2:
        return image[None]
    if image.ndim == 3:
        return image if file.suffix.lower() == ".npy" else np.moveaxis(image, -1, 0)
    expected = "(H, W) or (C, H, W)" if file.suffix.lower() == ".npy" else "(H, W) or (H, W, C)"
    raise ImageError(f"{file}: an image of shape {image.shape}; expected {expected}")
