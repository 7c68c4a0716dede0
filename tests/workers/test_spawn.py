"""Workers started with `spawn` (macOS's default, common with CUDA): our hooks must pickle and
import."""

from __future__ import annotations

from typing import Any

from loader_resume import ResumableDataLoader
from loader_resume.testing import assert_resumes_exactly, run_epochs
from support.data import Augmented, StatefulShards


def test_map_style_resumes_exactly_with_spawned_workers() -> None:
    def build(context: str | None) -> ResumableDataLoader[Any]:
        return ResumableDataLoader(Augmented(9), batch_size=2, shuffle=True, num_workers=2,
                                   multiprocessing_context=context)

    assert run_epochs(build("spawn"), 1) == run_epochs(build(None), 1)
    assert_resumes_exactly(lambda: build("spawn"), epochs=1, cuts=[2])


def test_iterable_resumes_exactly_with_spawned_workers() -> None:
    def build() -> ResumableDataLoader[Any]:
        return ResumableDataLoader(
            StatefulShards(9), batch_size=2, num_workers=2, multiprocessing_context="spawn"
        )

    assert_resumes_exactly(build, epochs=1, cuts=[3])
