"""Image data for the CNN, VGG-16 and ResNet-50 recipes, loaded and decoded by NVIDIA DALI.

DALI reads encoded files and decodes them on the GPU (``device="mixed"``) when the Trainer
runs on one, with CPU operators otherwise, so the same datamodule serves CI and a GPU run.
Without a folder of the user's, scikit-learn's handwritten digits are written once as PNG
files (upscaled to ``image_size``), so the pipeline really reads and decodes images and
nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from jsonargparse.typing import PositiveInt
from lightning.pytorch import LightningDataModule

try:
    from nvidia.dali import fn, pipeline_def, types
    from nvidia.dali.plugin.pytorch import DALIClassificationIterator, LastBatchPolicy
except ImportError as err:  # pragma: no cover - depends on the installation
    raise ImportError(
        "the image recipes load data with NVIDIA DALI, which is not installed: "
        "pip install 'cswap-lightning[dali]' (nvidia-dali-cuda130; Linux x86_64 or aarch64)"
    ) from err

DIGITS = 1797  # images in scikit-learn's digits data set
SPLITS = ("train", "val")
READER = "reader"


def write_digits(root: Path, num_samples: int, image_size: int, channels: int, seed: int) -> None:
    """Write ``num_samples`` digits as PNGs in ``root/{train,val}/<digit>/``, split 80/20.

    Written into a temporary sibling first and renamed, so a reader never sees a half-written
    folder and concurrent writers (one per node) do not collide.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    order = np.random.default_rng(seed).permutation(DIGITS)[:num_samples]
    n_train = int(0.8 * num_samples)
    mode = {1: "L", 3: "RGB"}[channels]
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=root.name + ".", dir=root.parent))
    for split in SPLITS:  # every class in both splits, so DALI numbers them alike
        for digit in range(10):
            (staging / split / str(digit)).mkdir(parents=True)
    for position, index in enumerate(order):
        pixels = (digits.images[index] * (255 / 16)).astype(np.uint8)
        image = Image.fromarray(pixels, "L").resize((image_size, image_size), Image.BILINEAR)
        split = SPLITS[position >= n_train]
        image.convert(mode).save(staging / split / str(digits.target[index]) / f"{index}.png")
    try:
        staging.rename(root)
    except OSError:  # another process finished first: use its copy
        shutil.rmtree(staging)


class DALIBatches(DALIClassificationIterator):
    """DALI's classification iterator as Lightning consumes it.

    Yields ``(images, labels)`` with int64 labels, and starts every pass over it at the
    beginning of an epoch: Lightning stops passes early (sanity check, ``limit_*_batches``,
    ``max_steps``) and DALI iterators cannot be reset mid-epoch, so the rest of an
    unfinished epoch is read and dropped first.
    """

    _in_epoch = False

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            batch = super().__next__()[0]
        except StopIteration:
            self._in_epoch = False
            raise
        self._in_epoch = True
        return batch["data"], batch["label"].squeeze(-1).long()

    def __iter__(self) -> DALIBatches:
        while self._in_epoch:
            with contextlib.suppress(StopIteration):
                next(self)
        return super().__iter__()


@pipeline_def
def _image_pipeline(
    file_root: str, train: bool, decoder: str, image_size: int, channels: int,
    shard_id: int, num_shards: int,
):
    encoded, labels = fn.readers.file(
        file_root=file_root, random_shuffle=train, shard_id=shard_id, num_shards=num_shards,
        pad_last_batch=True, name=READER,
    )
    images = fn.decoders.image(
        encoded, device=decoder, output_type=types.RGB if channels == 3 else types.GRAY
    )
    images = fn.resize(images, size=[image_size, image_size])
    images = fn.crop_mirror_normalize(
        images, dtype=types.FLOAT, output_layout="CHW", mean=[0.0] * channels,
        std=[255.0] * channels,
    )
    return images, labels


class DALIImageDataModule(LightningDataModule):
    """Classification images read and decoded by DALI, one shard per rank.

    Args:
        data_dir: a folder with ``train/`` and ``val/``, each holding one subfolder of
            images per class (the ImageNet layout); ``None`` uses scikit-learn's digits.
        image_size: images are resized to ``image_size`` x ``image_size``.
        channels: 3 (RGB) or 1 (grayscale).
        batch_size: images per batch and rank.
        num_samples: digits to generate (at most 1797; ignored with ``data_dir``).
        cache_dir: where generated digits are written (default: the system's temp folder).
        num_threads: DALI CPU threads per pipeline.
        seed: seeds the digits' train/val split and DALI's shuffling.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        image_size: PositiveInt = 224,
        channels: int = 3,
        batch_size: PositiveInt = 64,
        num_samples: int = DIGITS,
        cache_dir: str | None = None,
        num_threads: PositiveInt = 2,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 (grayscale) or 3 (RGB), got {channels!r}")
        if data_dir is None and not 2 <= num_samples <= DIGITS:
            raise ValueError(
                f"num_samples must be in [2, {DIGITS}] (scikit-learn's digits), got "
                f"{num_samples!r}; for more images point data_dir at an image folder"
            )
        self.data_dir = data_dir
        self.image_size = image_size
        self.channels = channels
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.cache_dir = cache_dir
        self.num_threads = num_threads
        self.seed = seed
        self._loaders: dict[str, DALIBatches] = {}

    @property
    def root(self) -> Path:
        """The folder read: the user's ``data_dir``, or where the digits are generated."""
        if self.data_dir is not None:
            return Path(self.data_dir)
        cache = Path(self.cache_dir or Path(tempfile.gettempdir()) / "cswap-lightning")
        name = f"digits-{self.num_samples}-{self.image_size}px-{self.channels}ch-seed{self.seed}"
        return cache / name

    def folder(self, split: str) -> Path:
        folder = self.root / split
        if not folder.is_dir():
            raise FileNotFoundError(
                f"{folder} does not exist: data_dir must hold 'train' and 'val' folders with "
                "one subfolder of images per class"
            )
        return folder

    def prepare_data(self) -> None:
        if self.data_dir is None and not self.root.exists():
            write_digits(self.root, self.num_samples, self.image_size, self.channels, self.seed)

    def setup(self, stage: str) -> None:
        classes = [sorted(d.name for d in self.folder(s).iterdir() if d.is_dir()) for s in SPLITS]
        if classes[0] != classes[1]:
            raise ValueError(
                f"{self.root}: 'train' and 'val' must hold the same class folders (DALI numbers "
                f"classes by their sorted folder names); got {classes[0]} and {classes[1]}"
            )
        device = self.trainer.strategy.root_device
        device_id = device.index if device.type == "cuda" else None
        for split in SPLITS:
            self._loaders[split] = self.loader(
                split, self.trainer.global_rank, self.trainer.world_size, device_id
            )

    def loader(
        self, split: str, shard_id: int = 0, num_shards: int = 1, device_id: int | None = None
    ) -> DALIBatches:
        """A DALI iterator over shard ``shard_id`` of ``num_shards`` of ``split``.

        ``device_id`` is the CUDA device that decodes (``None``: decode on the CPU).
        """
        pipeline = _image_pipeline(
            file_root=str(self.folder(split)), train=split == "train",
            decoder="cpu" if device_id is None else "mixed", image_size=self.image_size,
            channels=self.channels, shard_id=shard_id, num_shards=num_shards,
            batch_size=self.batch_size, num_threads=self.num_threads, device_id=device_id,
            seed=self.seed + shard_id,
        )
        pipeline.build()
        policy = LastBatchPolicy.DROP if split == "train" else LastBatchPolicy.PARTIAL
        return DALIBatches(pipeline, reader_name=READER, last_batch_policy=policy, auto_reset=True)

    def train_dataloader(self) -> DALIBatches:
        return self._loaders["train"]

    def val_dataloader(self) -> DALIBatches:
        return self._loaders["val"]

    def teardown(self, stage: str) -> None:
        self._loaders.clear()  # the pipelines' threads and buffers go with them

