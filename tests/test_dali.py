"""The DALI image datamodule on CPU pipelines: real PNG files decoded, labelled and sharded."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

pytest.importorskip("nvidia.dali", reason="NVIDIA DALI is not installed: the image recipes' "
                    "data module needs it (pip install 'cswap-lightning[dali]')")

from cswap_lightning.recipes.images import DALIImageDataModule

SIZE = 16


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> DALIImageDataModule:
    data = DALIImageDataModule(
        image_size=SIZE, channels=3, batch_size=4, num_samples=40,
        cache_dir=str(tmp_path_factory.mktemp("digits")),
    )
    data.prepare_data()
    return data


def files_by_pixels(folder: Path) -> dict[bytes, int]:
    """Each PNG under ``folder``'s class subfolders, as CHW uint8 bytes -> its class index."""
    classes = sorted(d.name for d in folder.iterdir())
    return {
        np.asarray(Image.open(png).convert("RGB")).transpose(2, 0, 1).tobytes(): label
        for label, name in enumerate(classes)
        for png in (folder / name).glob("*.png")
    }


def samples(batches) -> list[tuple[bytes, int]]:
    """The (pixels as uint8 bytes, label) of every image in ``batches``."""
    return [
        ((image * 255).round().to(torch.uint8).numpy().tobytes(), int(label))
        for images, labels in batches
        for image, label in zip(images, labels)
    ]


def test_generated_digits_are_png_files_in_both_splits(digits):
    for split, count in (("train", 32), ("val", 8)):
        folder = digits.root / split
        assert sorted(d.name for d in folder.iterdir()) == [str(d) for d in range(10)]
        assert len(list(folder.rglob("*.png"))) == count


def test_batches_are_the_decoded_files_with_their_labels(digits):
    loader = digits.loader("train")
    batches = list(loader)
    assert len(batches) == len(loader) == 32 // 4
    for images, labels in batches:
        assert images.shape == (4, 3, SIZE, SIZE) and images.dtype == torch.float32
        assert 0.0 <= images.min() and images.max() <= 1.0 and images.max() > 0.5
        assert labels.shape == (4,) and labels.dtype == torch.int64
    expected = files_by_pixels(digits.root / "train")
    seen = samples(batches)
    assert sorted(pixels for pixels, _ in seen) == sorted(expected)  # each file once
    assert all(expected[pixels] == label for pixels, label in seen)


@pytest.mark.parametrize("split", ["train", "val"])
def test_two_shards_read_disjoint_halves(digits, split):
    shards = [{pixels for pixels, _ in samples(digits.loader(split, s, 2))} for s in (0, 1)]
    assert shards[0] and shards[1] and not shards[0] & shards[1]
    assert shards[0] | shards[1] == set(files_by_pixels(digits.root / split))


def test_every_pass_starts_a_full_epoch(digits):
    loader = digits.loader("val")
    first = next(iter(loader))  # a pass stopped early, as Lightning's sanity check does
    assert len(first[1]) == 4
    assert len(samples(loader)) == 8
    assert len(samples(loader)) == 8


def test_user_folder_is_resized_and_labelled_by_class_folder(tmp_path):
    for split in ("train", "val"):
        for name, shade in (("cat", 0), ("dog", 255)):
            (tmp_path / split / name).mkdir(parents=True)
            for i in range(3):  # sizes vary, as in a real folder
                pixels = np.full((20 + i, 30, 3), shade, np.uint8)
                Image.fromarray(pixels).save(tmp_path / split / name / f"{i}.jpg")
    data = DALIImageDataModule(data_dir=str(tmp_path), image_size=12, channels=1, batch_size=2)
    for images, labels in data.loader("val"):
        assert images.shape[1:] == (1, 12, 12)
        assert torch.equal(images.mean(dim=(1, 2, 3)).round(), labels.float())


def test_class_folders_must_match_between_splits(tmp_path):
    for split, names in (("train", ("a", "b")), ("val", ("a",))):
        for name in names:
            (tmp_path / split / name).mkdir(parents=True)
    with pytest.raises(ValueError, match=r"same class folders.*\['a', 'b'\] and \['a'\]"):
        DALIImageDataModule(data_dir=str(tmp_path)).setup("fit")


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "nowhere" / "train")):
        DALIImageDataModule(data_dir=str(tmp_path / "nowhere")).loader("train")


@pytest.mark.parametrize("bad", [{"num_samples": 5000}, {"channels": 2}])
def test_bad_arguments_are_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        DALIImageDataModule(**bad)


@pytest.mark.gpu
def test_gpu_decoding_matches_cpu(digits):
    on_gpu = list(digits.loader("val", device_id=torch.cuda.current_device()))
    assert on_gpu[0][0].is_cuda and on_gpu[0][1].is_cuda
    on_cpu = list(digits.loader("val"))
    for (gpu_images, gpu_labels), (cpu_images, cpu_labels) in zip(on_gpu, on_cpu):
        torch.testing.assert_close(gpu_images.cpu(), cpu_images, atol=1 / 255, rtol=0)
        assert torch.equal(gpu_labels.cpu(), cpu_labels)
