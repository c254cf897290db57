"""Data sets and loaders: a synthetic CIFAR-shaped set, CIFAR-10 from disk, sharded loading.

Distributed data loading has three rules, and this module keeps them in one place:

1. every rank reads a *different* shard (``DistributedSampler``), and the shards change
   every epoch (``sampler.set_epoch(epoch)``);
2. every rank runs the *same number* of steps (``drop_last``), or the collectives of the
   longer ranks wait forever for the shorter ones;
3. evaluation counts every test sample exactly once: ``DistributedSampler`` pads the last
   round with duplicates, so :func:`evaluate` masks those out by their position.
"""

from __future__ import annotations

import os
import pickle
import socket

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddp_lab.dist import DistEnv, all_reduce_sum
from ddp_lab.errors import UsageError
from ddp_lab.text import TEXT_DATASETS, make_text_datasets

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
#: bytes of one float32 sample, and the largest synthetic set held in memory (per split)
SAMPLE_BYTES = 4 * 3 * 32 * 32
MEMORY_BYTES = 256 * 2**20
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR10_FILES = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch", "batches.meta"]


class SyntheticCIFAR(Dataset):
    """A learnable, seeded, CIFAR-shaped data set that needs no download.

    Each class has a fixed smooth "prototype" image; a sample is its class prototype plus
    Gaussian noise. A linear model separates the classes well, so accuracy climbs far above
    chance (10 %) within one epoch, yet single samples are noisy enough for a loss curve to
    mean something. Sample ``index`` is generated from ``(seed, split, index)`` alone, so
    every process sees the same bytes; a set of up to ``MEMORY_BYTES`` (256 MiB, 21 845
    samples) is generated once when it is built and held in memory, a larger one on access.

    Args:
        size: number of samples.
        split: ``"train"`` or ``"test"`` (same prototypes, different noise and labels).
        seed: data seed; the same seed gives the same data set bit for bit.
        signal: prototype amplitude relative to the unit noise.

    Example:
        >>> ds = SyntheticCIFAR(100)
        >>> x, y = ds[0]
        >>> tuple(x.shape), 0 <= y < 10
        ((3, 32, 32), True)
    """

    def __init__(self, size: int, split: str = "train", seed: int = 0, signal: float = 0.15):
        if size <= 0:
            raise UsageError(f"a data set needs at least one sample, got size={size}")
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        self.size, self.split, self.seed = size, split, seed
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(NUM_CLASSES, 3, 8, 8, generator=g)
        self.prototypes = (
            signal
            * torch.nn.functional.interpolate(
                coarse, size=IMAGE_SHAPE[1:], mode="bilinear", align_corners=False
            )
            / coarse.std()
        )
        self._offset = 0 if split == "train" else 1_000_003
        labels = torch.Generator().manual_seed(seed * 7919 + self._offset + 1)
        self.targets = torch.randint(0, NUM_CLASSES, (size,), generator=labels)

        self._labels = self.targets.tolist()
        # Generating a sample (3072 normal draws) costs about 30 us: 1 ms of every step of
        # 32 samples, which a set held in memory does not pay. So a set up to MEMORY_BYTES
        # is generated once, here, before training starts; the bytes are the same.
        self._images = None
        if size * SAMPLE_BYTES <= MEMORY_BYTES:
            images = torch.empty(size, *IMAGE_SHAPE)
            for index in range(size):
                images[index] = self._generate(index)
            self._images = images

    def _generate(self, index: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_033 + self._offset + index) % 2**63)
        return self.prototypes[self._labels[index]] + torch.randn(IMAGE_SHAPE, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        x = self._generate(index) if self._images is None else self._images[index].clone()
        return x, self._labels[index]


def _cifar10_class():
    """torchvision's CIFAR10, checking that the files exist rather than their MD5 sums.

    torchvision verifies every file's MD5 on each load; that rejects the small fixtures the
    tests write, and costs a second per start. A truncated or corrupt file still fails to
    unpickle, which :func:`load_cifar10` turns into a clear error.
    """
    from torchvision.datasets import CIFAR10

    class CIFAR10Files(CIFAR10):
        def _check_integrity(self) -> bool:
            return cifar10_present(self.root)

        def _load_meta(self) -> None:
            with open(os.path.join(self.root, self.base_folder, self.meta["filename"]), "rb") as f:
                data = pickle.load(f, encoding="latin1")
            self.classes = data[self.meta["key"]]
            self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    return CIFAR10Files


def cifar10_present(data_dir: str) -> bool:
    """True when ``data_dir/cifar-10-batches-py`` holds all CIFAR-10 files.

    Example:
        >>> cifar10_present("/nonexistent")
        False
    """
    folder = os.path.join(data_dir, CIFAR10_FOLDER)
    return all(os.path.isfile(os.path.join(folder, f)) for f in CIFAR10_FILES)


def download_cifar10(data_dir: str, timeout_s: float = 20.0) -> None:
    """Download CIFAR-10 into ``data_dir`` through torchvision.

    Raises:
        UsageError: when the download fails (offline), naming both remedies.
    """
    from torchvision.datasets import CIFAR10

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout_s)
    try:
        CIFAR10(root=data_dir, train=True, download=True)
    except Exception as err:  # URLError, socket errors, HTTP errors, bad archive
        raise UsageError(
            f"CIFAR-10 is not in --data-dir {data_dir!r} and could not be downloaded "
            f"({type(err).__name__}: {err}); either put the extracted '{CIFAR10_FOLDER}' "
            "folder into --data-dir, or train on generated data with --dataset synthetic"
        ) from None
    finally:
        socket.setdefaulttimeout(old)


def load_cifar10(data_dir: str, train: bool, download: bool = True) -> Dataset:
    """CIFAR-10 from ``data_dir`` (downloaded first when missing and ``download`` is set).

    Images are normalised with the CIFAR-10 channel statistics; no random augmentation, so
    that runs are reproducible and the loaders never touch the global RNG.

    Args:
        data_dir: folder that holds (or will hold) ``cifar-10-batches-py``.
        train: the 50 000-image training split, or the 10 000-image test split.
        download: try to download when the files are missing.

    Raises:
        UsageError: files missing (and not downloadable), or unreadable.
    """
    import torchvision.transforms as T

    if not cifar10_present(data_dir):
        if not download:
            raise UsageError(
                f"CIFAR-10 is not in --data-dir {data_dir!r}; put the extracted "
                f"'{CIFAR10_FOLDER}' folder there, or use --dataset synthetic"
            )
        download_cifar10(data_dir)
    transform = T.Compose([T.ToTensor(), T.Normalize(CIFAR10_MEAN, CIFAR10_STD)])
    try:
        return _cifar10_class()(root=data_dir, train=train, transform=transform)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as err:
        raise UsageError(
            f"CIFAR-10 files in {os.path.join(data_dir, CIFAR10_FOLDER)!r} are corrupt "
            f"({type(err).__name__}); delete the folder and download again, or use "
            "--dataset synthetic"
        ) from None


def make_datasets(
    name: str,
    data_dir: str = "data",
    train_size: int = 10_000,
    test_size: int = 2_000,
    data_seed: int = 0,
    seq_len: int = 64,
) -> tuple[Dataset, Dataset]:
    """The training and test sets of ``name``: images (``"synthetic"``, ``"cifar10"``) or
    next-token windows of ``seq_len`` tokens (``"text"``, ``"tokens"``: :mod:`ddp_lab.text`).

    Only rank 0 may download; call this on rank 0 first (see ``ddp_lab.train``).

    Example:
        >>> train, test = make_datasets("synthetic", train_size=64, test_size=16)
        >>> len(train), len(test)
        (64, 16)
    """
    if name == "synthetic":
        return (
            SyntheticCIFAR(train_size, "train", data_seed),
            SyntheticCIFAR(test_size, "test", data_seed),
        )
    if name == "cifar10":
        return load_cifar10(data_dir, train=True), load_cifar10(data_dir, train=False)
    if name in TEXT_DATASETS:
        return make_text_datasets(name, seq_len, train_size, test_size, data_seed)
    raise UsageError(f"unknown dataset {name!r}; use synthetic, cifar10, text or tokens")


def make_train_loader(
    dataset: Dataset,
    batch_size: int,
    env: DistEnv,
    seed: int = 0,
    num_workers: int = 0,
) -> tuple[DataLoader, DistributedSampler]:
    """A training loader that reads this rank's shard, in batches of ``batch_size``.

    The sampler shuffles with its own seed; call ``sampler.set_epoch(epoch)`` before every
    epoch, or every epoch repeats the first one's order. ``drop_last`` makes every rank run
    the same number of full batches. The loader has its own seeded generator, so iterating
    it never draws from the global RNG (which would change the model's dropout or init).

    Args:
        dataset: the training set.
        batch_size: samples per step *per process*.
        env: this process's :class:`~ddp_lab.dist.DistEnv`.
        seed: shuffling seed, the same on every rank.
        num_workers: loader worker processes.

    Returns:
        ``(loader, sampler)``.
    """
    if batch_size <= 0:
        raise UsageError(f"--batch-size must be positive, got {batch_size}")
    sampler = DistributedSampler(
        dataset,
        num_replicas=env.world_size,
        rank=env.rank,
        shuffle=True,
        seed=seed,
        drop_last=True,
    )
    if len(sampler) < batch_size:
        raise UsageError(
            f"each of the {env.world_size} process(es) gets {len(sampler)} training samples, "
            f"fewer than one batch of {batch_size}; lower --batch-size or use more data"
        )
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=env.device.type == "cuda",
        generator=torch.Generator().manual_seed(seed),
        persistent_workers=num_workers > 0,
    )
    return loader, sampler


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, dataset: Dataset, env: DistEnv, batch_size: int = 256
) -> dict[str, float]:
    """Exact distributed evaluation: every sample of ``dataset`` is counted exactly once.

    Every rank reads its part through ``DistributedSampler(shuffle=False, drop_last=False)``,
    which deals the samples out round-robin and pads the last round with repeats of the first
    samples, so that every rank runs the same number of batches. The ``k``-th sample a rank
    reads sits at position ``rank + k * world_size`` of that padded list, and the positions
    from ``len(dataset)`` on are the repeats: their hits and losses are masked out before the
    per-rank sums (hits, real samples, summed loss) are added up over the ranks.

    Why this way: the lab's exercise 3 asks students to write exact evaluation themselves
    (a split without padding, then summed counts). The runtime reaches the same numbers by
    another route, the masked padding, so that the student kit holds no copy of the
    exercise's answer; and every rank runs the same number of forward passes.

    A sample may hold several predictions (a sequence of ``seq_len`` next tokens): accuracy
    and loss are then means over every prediction of every real sample.

    Pass the *unwrapped* model (``ddp.module``): an evaluation forward needs no collective.

    Returns:
        ``{"accuracy", "loss", "samples"}`` over the whole data set, identical on all ranks.

    Example:
        >>> ds = torch.utils.data.TensorDataset(torch.zeros(5, 2), torch.zeros(5).long())
        >>> evaluate(torch.nn.Linear(2, 3), ds, DistEnv())["samples"]
        5
    """
    size = len(dataset)
    sampler = DistributedSampler(
        dataset, num_replicas=env.world_size, rank=env.rank, shuffle=False, drop_last=False
    )
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64)  # hits, real samples, predictions, summed loss
    read = 0
    for x, y in DataLoader(dataset, batch_size=batch_size, sampler=sampler):
        x, y = x.to(env.device), y.to(env.device)
        logits = model(x).flatten(0, -2)  # (predictions, classes)
        position = env.rank + env.world_size * torch.arange(read, read + len(y))
        real = (position < size).to(env.device)
        read += len(y)
        per_sample = y[0].numel()  # predictions per sample: 1, or a sequence's tokens
        y, counted = y.flatten(), real.repeat_interleave(per_sample)
        hits = (logits.argmax(1) == y) & counted
        losses = torch.nn.functional.cross_entropy(logits, y, reduction="none")
        sums += (
            torch.stack([hits.sum(), real.sum(), counted.sum(), losses[counted].sum()])
            .double()
            .cpu()
        )
    model.train(was_training)
    hits, samples, predictions, loss = all_reduce_sum(sums, env).tolist()
    return {"accuracy": hits / predictions, "loss": loss / predictions, "samples": int(samples)}


def choose_dataset(data_dir: str = "data", allow_download: bool = True) -> tuple[str, str]:
    """Pick CIFAR-10 when it is there (or downloadable), the synthetic set otherwise.

    Used by ``make lab3`` and the notebooks, which must say which data they train on and
    why. (The trainer itself never switches: ``--dataset cifar10`` without the files fails.)

    Returns:
        ``(name, reason)``, e.g. ``("synthetic", "CIFAR-10 is not in 'data' and ...")``.

    Example:
        >>> choose_dataset("/nonexistent", allow_download=False)[0]
        'synthetic'
    """
    if cifar10_present(data_dir):
        return "cifar10", f"CIFAR-10 found in {data_dir!r}"
    if allow_download:
        try:
            download_cifar10(data_dir)
            return "cifar10", f"CIFAR-10 downloaded into {data_dir!r}"
        except UsageError:
            pass
    return "synthetic", (
        f"CIFAR-10 is not in {data_dir!r} and could not be downloaded (offline?); using the "
        "generated CIFAR-shaped set instead"
    )
