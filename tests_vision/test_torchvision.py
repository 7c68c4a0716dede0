"""torchvision for real: transforms v2 drawing from torch's generator inside a map-style dataset,
and ``torchvision.datasets.FakeData`` (which draws its images from a generator of its own, seeded
per index) with a random transform. Exact at every cut at ``num_workers`` 0 and 2, the same values
at either count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.transforms import v2

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, run_epochs

N = 24
AUGMENT = v2.Compose([
    v2.RandomResizedCrop(8, scale=(0.3, 1.0), antialias=True),
    v2.RandomHorizontalFlip(),
    v2.ColorJitter(brightness=0.5, contrast=0.5, saturation=0.5, hue=0.1),
])


class Images(Dataset[dict[str, Any]]):
    """Deterministic 3x16x16 images, augmented as a vision training set does."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> dict[str, Any]:
        image = (
            torch.arange(3 * 16 * 16, dtype=torch.float32)
            .reshape(3, 16, 16)
            .add(index)
            .remainder(255)
            / 255
        )
        return {"id": index, "image": AUGMENT(image)}


def _images(workers: int) -> ResumableDataLoader[Any]:
    return ResumableDataLoader(Images(), batch_size=4, shuffle=True, seed=1, num_workers=workers)


def _fake(workers: int) -> ResumableDataLoader[Any]:
    fake = datasets.FakeData(
        size=N,
        image_size=(3, 16, 16),
        num_classes=3,
        transform=v2.Compose([v2.ToImage(), v2.ToDtype(torch.float32, scale=True), AUGMENT]),
    )
    return ResumableDataLoader(fake, batch_size=4, shuffle=True, seed=1, num_workers=workers)


@pytest.mark.parametrize("make", [_images, _fake], ids=["transforms_v2", "FakeData"])
def test_random_transforms_are_the_same_at_any_worker_count(make: Any) -> None:
    in_process = run_epochs(make(0), 2)
    assert run_epochs(make(2), 2) == in_process
    images = [b["image"] if isinstance(b, dict) else b[0] for b in make(0)]
    # the augmentation is not a no-op
    assert len({bytes(image.numpy()) for image in images}) == len(images)


@pytest.mark.parametrize("make", [_images, _fake], ids=["transforms_v2", "FakeData"])
@pytest.mark.parametrize("workers", [0, 2])
def test_random_transforms_resume_exactly_at_every_cut(make: Any, workers: int) -> None:
    assert_resumes_exactly(lambda: make(workers), epochs=2)


def test_the_transforms_draw_from_the_keyed_generator() -> None:
    """Two epochs of the same images differ (the keys change with the epoch): the values are keyed,
    not fixed."""
    loader = _images(0)
    first, second = ([b["image"][0] for b in loader] for _ in range(2))
    assert not torch.equal(torch.stack(first), torch.stack(second))
