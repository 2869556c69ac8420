"""`fedsaddle data split` on images: an N x C x H x W array with its labels, a .npz, a folder of class
subfolders of PNG and .npy images; client files the built-in problems read; faults named."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import fedsaddle

from fedsaddle.common.problems import read_client_data
from fedsaddle.experiments.datasets import load_image_table, split
from fedsaddle.experiments.images import ImageError

SHAPE = (3, 5, 4)  # C, H, W


def images(count: int = 90, seed: int = 0, classes: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """uint8 images whose first channel's brightness follows the class (so the classes can be told apart)."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % classes + 10  # labels 10, 11, 12: classes are found, not assumed 0..K-1
    pixels = rng.integers(0, 120, size=(count, *SHAPE)).astype(np.uint8)
    pixels[:, 0] += (40 * (labels - 10)).astype(np.uint8)[:, None, None]
    return pixels, labels


def test_an_array_of_images_with_its_labels_splits_into_client_files_of_flattened_rows(tmp_path: Path) -> None:
    pixels, labels = images()
    np.save(tmp_path / "images.npy", pixels)
    np.save(tmp_path / "labels.npy", labels)
    out = tmp_path / "data"
    done = fedsaddle(
        "data", "split", str(tmp_path / "images.npy"), "--labels", str(tmp_path / "labels.npy"),
        "--partition", "label-skew", "--clients", "3", "--seed", "1", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "images of 3 x 5 x 4 (C x H x W), each a row of 60 pixels" in done.stdout
    assert "3 classes: ['10', '11', '12'] (labels 0..2)" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["image_shape"] == [3, 5, 4] and summary["task"] == "multiclass"
    assert summary["classes"] == ["10", "11", "12"] and summary["statistics"] == {}
    datas = [read_client_data(out / f"client-{c:03d}.npz") for c in range(3)]
    assert sum(d.samples + d.heldout for d in datas) == 90
    assert all(d.X.shape[1] == 60 for d in datas)
    for data, share in zip(datas, summary["shares"], strict=True):
        assert np.bincount(data.y.astype(int), minlength=3).tolist() == share["class_counts"]
    # Standardized per channel with the training images' pixels: each channel has mean 0 and deviation 1 there.
    train = np.concatenate([d.X for d in datas]).reshape(-1, *SHAPE)
    np.testing.assert_allclose(train.mean(axis=(0, 2, 3)), 0, atol=1e-12)
    np.testing.assert_allclose(train.std(axis=(0, 2, 3)), 1, rtol=1e-12)
    # A row is the image flattened in C order: undo the standardization of one image and compare.
    table = load_image_table(tmp_path / "images.npy", tmp_path / "labels.npy")
    np.testing.assert_array_equal(table.X[7], pixels[7].reshape(-1) / 255.0)


def test_a_npz_of_images_and_one_class_against_the_rest_fits_the_auc_problem(tmp_path: Path) -> None:
    pixels, labels = images()
    np.savez(tmp_path / "digits.npz", images=pixels, labels=labels)
    out, config = tmp_path / "data", tmp_path / "run.yaml"
    done = fedsaddle(
        "data", "split", str(tmp_path / "digits.npz"), "--positive", "12", "--clients", "3",
        "--out", str(out), "--config", str(config),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"] == "classification" and summary["codes"] == {"target": {"12": 1, "the other classes": 0}}
    datas = [read_client_data(out / f"client-{c:03d}.npz") for c in range(3)]
    positives = sum(float(d.y.sum()) for d in datas)
    assert summary["statistics"]["auc"] == {"features": 60, "positive_rate": positives / summary["training_rows"]}
    assert 0.2 < summary["positive_rate"] < 0.45  # a third of the images are of class 12
    # The written config runs on the files, in process (a shorter run than its starter's 1000 rounds).
    config.write_text(config.read_text().replace("rounds: 1000", "rounds: 200"))
    ran = fedsaddle(
        "simulate", "--config", str(config), "--data", str(out / "client-{i:03d}.npz"), "--out", str(tmp_path / "runs")
    )
    assert ran.returncode == 0, ran.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    results = json.loads((run_dir / "summary.json").read_text())["algorithms"]
    assert all(r["status"] == "ok" and r["metrics"]["test_auc"] > 0.6 for r in results), results


def test_a_folder_of_class_subfolders_of_png_and_npy_images_splits_as_the_same_array(tmp_path: Path) -> None:
    pytest.importorskip("PIL", reason="image files need Pillow (the data extra)")
    from PIL import Image

    pixels, labels = images(count=24, classes=2)
    folder = tmp_path / "pictures"
    for k, (image, label) in enumerate(zip(pixels, labels, strict=True)):
        kind = folder / ("ship" if label == 10 else "truck")
        kind.mkdir(parents=True, exist_ok=True)
        if k % 2:  # half as PNG files (H x W x C, as the file holds it), half as .npy arrays (C x H x W)
            Image.fromarray(np.moveaxis(image, 0, -1)).save(kind / f"{k:03d}.png")
        else:
            np.save(kind / f"{k:03d}.npy", image)
    (folder / "ship" / "notes.txt").write_text("not an image: left alone")
    table = load_image_table(folder)
    assert table.image_shape == SHAPE and table.task == "classification"
    assert table.codes == {"target": {"ship": 0, "truck": 1}}
    # In sorted file order within each class: the pixels come back exactly (PNG is lossless).
    order = sorted(range(24), key=lambda k: (labels[k] != 10, f"{k:03d}"))
    np.testing.assert_array_equal(table.X, pixels[order].reshape(24, -1) / 255.0)
    np.testing.assert_array_equal(table.y, (labels[order] == 11).astype(float))
    summary = split(table, 2, "iid", seed=0, out=tmp_path / "data")
    assert summary["image_shape"] == [3, 5, 4] and summary["statistics"]["auc"]["features"] == 60


def test_a_table_splits_as_before_beside_the_image_options(tmp_path: Path) -> None:
    # (the table path is untouched: no image_shape, per-column standardization)
    (tmp_path / "t.csv").write_text("a,b,y\n" + "".join(f"{i},{i % 3},{i % 2}\n" for i in range(40)))
    done = fedsaddle(
        "data", "split", str(tmp_path / "t.csv"), "--target", "y", "--clients", "2", "--out", str(tmp_path / "d")
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "d" / "summary.json").read_text())
    assert "image_shape" not in summary and summary["feature_names"] == ["a", "b"]
    refused = fedsaddle("data", "split", str(tmp_path / "t.csv"), "--labels", "l.npy", "--clients", "2", "--out", "x")
    assert refused.returncode == 2 and "--labels gives the labels of images in a .npy file" in refused.stderr


@pytest.mark.parametrize(
    ("make", "extra", "error"),
    [
        (lambda p: np.save(p / "i.npy", np.zeros((4, 2, 2))), [], "give the images' labels with --labels"),
        (
            lambda p: (np.save(p / "i.npy", np.zeros((4, 2, 2))), np.save(p / "l.npy", np.zeros(3))),
            ["--labels", "l.npy"],
            "4 images but labels of shape (3,)",
        ),
        (
            lambda p: (np.save(p / "i.npy", np.zeros((4, 5))), np.save(p / "l.npy", np.zeros(4))),
            ["--labels", "l.npy"],
            "images of shape (4, 5); expected (N, C, H, W) or (N, H, W)",
        ),
        (
            lambda p: (np.save(p / "i.npy", np.full((4, 2, 2), np.nan)), np.save(p / "l.npy", np.arange(4))),
            ["--labels", "l.npy"],
            "pixel [0, 0, 0, 0] is nan (NaN and Inf are refused)",
        ),
        (
            lambda p: (np.save(p / "i.npy", np.zeros((4, 2, 2))), np.save(p / "l.npy", np.full(4, 0.5))),
            ["--labels", "l.npy"],
            "the labels must be whole numbers (classes)",
        ),
        (lambda p: np.savez(p / "i.npz", pixels=np.zeros((4, 2, 2))), [], "its images go under images or X"),
        (
            lambda p: (np.save(p / "i.npy", np.zeros((4, 2, 2))), np.save(p / "l.npy", np.zeros(4))),
            ["--labels", "l.npy"],
            "one class only ('0')",
        ),
        (lambda p: np.save(p / "i.npy", np.zeros((4, 2, 2))), ["--target", "y"], "holds images: their classes"),
        (
            lambda p: (np.save(p / "i.npy", np.zeros((4, 2, 2))), np.save(p / "l.npy", np.arange(4))),
            ["--labels", "l.npy", "--partition", "by-column"],
            "images have no site column",
        ),
    ],
)
def test_bad_images_are_refused_naming_the_file_and_the_fault(
    tmp_path: Path, make: object, extra: list[str], error: str
) -> None:
    make(tmp_path)  # type: ignore[operator]
    source = next(str(p) for p in sorted(tmp_path.iterdir()) if p.name.startswith("i."))
    extra = [str(tmp_path / a) if a.endswith(".npy") else a for a in extra]
    done = fedsaddle("data", "split", source, *extra, "--clients", "2", "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and error in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_folder_of_images_of_two_shapes_or_no_class_folders_is_refused(tmp_path: Path) -> None:
    for kind, shape in (("a", (1, 2, 2)), ("b", (1, 3, 2))):
        (tmp_path / kind).mkdir()
        np.save(tmp_path / kind / "0.npy", np.zeros(shape))
    with pytest.raises(ImageError, match=r"b/0.npy: an image of shape \(1, 3, 2\), but .*a/0.npy has \(1, 2, 2\)"):
        load_image_table(tmp_path)
    with pytest.raises(ImageError, match="0 subfolder"):
        load_image_table(tmp_path / "a")
    np.save(tmp_path / "b" / "0.npy", np.zeros((1, 2, 2)))
    (tmp_path / "c").mkdir()
    with pytest.raises(ImageError, match=r"no images .* in class 'c'"):
        load_image_table(tmp_path)
