"""Drop-in: DataLoader's arguments, defaults and errors; rebuilding from attributes; iterable
pass-through."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from loader_resume import ResumableDataLoader
from loader_resume.testing import run_epochs
from support.data import Augmented, StatefulShards, ids, make


def test_accepts_every_dataloader_parameter_with_the_same_default() -> None:
    ours = inspect.signature(ResumableDataLoader.__init__).parameters
    for name, parameter in inspect.signature(DataLoader.__init__).parameters.items():
        assert name in ours, name
        assert ours[name].default == parameter.default, name
        assert ours[name].kind == parameter.kind, name


BAD = [
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"num_workers": 2, "prefetch_factor": -1},
    {"persistent_workers": True},
    {"batch_sampler": [[0, 1]], "batch_size": 2},
    {"batch_sampler": [[0, 1]], "batch_size": None, "drop_last": True},
    {"sampler": [0, 1], "shuffle": True},
    {"num_workers": 2, "multiprocessing_context": "no-such-method"},
    {"multiprocessing_context": "spawn"},
]


@pytest.mark.parametrize("kwargs", BAD)
def test_invalid_combinations_raise_the_same_errors_as_dataloader(kwargs: dict[str, Any]) -> None:
    with pytest.raises(Exception) as theirs:
        DataLoader(Augmented(4), **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        ResumableDataLoader(Augmented(4), **kwargs)
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"keying": "per-sample"},
            r"keying='per-sample': expected one of \['batch', 'sample', 'off'\]",
        ),
        (
            {"snapshot_every_n_steps": -1},
            r"snapshot_every_n_steps=-1: expected None or an int >= 0",
        ),
        (
            {"rank": 2, "world_size": 2},
            r"rank=2, world_size=2: expected world_size >= 1 and 0 <= rank",
        ),
    ],
)
def test_our_own_options_fail_clearly(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(4, **kwargs)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("seed", 5),
        ("keying", "off"),
        ("keyed_generators", ("torch",)),
        ("rank", 1),
        ("world_size", 2),
        ("in_order", False),
    ],
)
def test_our_settings_cannot_be_set_after_construction(name: str, value: Any) -> None:
    """As DataLoader refuses ``batch_size``: the order, the keys and the state follow one value, the
    one the loader was built with; a write is refused and changes nothing."""
    loader = make(10, shuffle=True, seed=0)
    before = (run_epochs(loader, 1), loader.state_dict())
    with pytest.raises(
        ValueError,
        match=rf"{name} attribute should not be set after ResumableDataLoader is "
        rf"initialized .* build a new loader with {name}=",
    ):
        setattr(loader, name, value)
    assert (loader.seed, loader.keying, loader.keyed_generators) == (
        0,
        "batch",
        ("torch", "numpy", "random"),
    )
    assert (run_epochs(make(10, shuffle=True, seed=0), 1), loader.state_dict()["seed"]) == (
        before[0],
        0,
    )
    assert loader.in_order and "ahead" not in loader.state_dict()


def test_dataloaders_own_settings_are_refused_after_construction_as_dataloader_refuses_them() -> (
    None
):
    loader = make(10)
    for name, value in (
        ("batch_size", 3),
        ("drop_last", True),
        ("sampler", None),
        ("batch_sampler", None),
        ("dataset", [1]),
        ("persistent_workers", True),
    ):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after"):
            setattr(loader, name, value)


def test_num_workers_written_after_construction_takes_effect_everywhere_from_the_next_pass() -> (
    None
):
    """DataLoader lets ``num_workers`` change between passes: the state reports the new value and a
    stream state saved with that many workers loads (the loader re-shards nothing)."""
    saving = ResumableDataLoader(StatefulShards(12), batch_size=2, num_workers=2)
    it = iter(saving)
    next(it), next(it), next(it)
    state = saving.state_dict()
    loader = ResumableDataLoader(StatefulShards(12), batch_size=2, num_workers=1)
    loader.num_workers = 2
    assert loader.state_dict()["num_workers"] == 2
    loader.load_state_dict(state)
    rest = [b["id"].tolist() for b in loader]
    uninterrupted = [
        b["id"].tolist()
        for b in ResumableDataLoader(StatefulShards(12), batch_size=2, num_workers=2)
    ]
    assert rest == uninterrupted[3:]


_INIT = [name for name in inspect.signature(DataLoader.__init__).parameters if name != "self"]


@pytest.mark.parametrize(
    "options", [{"shuffle": True}, {"batch_size": None}, {"drop_last": True, "num_workers": 2}]
)
def test_rebuilding_from_attributes_gives_an_equivalent_loader(options: dict[str, Any]) -> None:
    """Lightning and Accelerate rebuild loaders from their attributes; the copy must behave the
    same."""
    original = make(10, **options)
    rebuilt_kwargs = {name: getattr(original, name) for name in _INIT if hasattr(original, name)}
    if rebuilt_kwargs.get("batch_sampler") is not None:  # DataLoader's own; passing both is invalid
        rebuilt_kwargs.pop("batch_sampler")
    rebuilt = ResumableDataLoader(**rebuilt_kwargs)
    assert rebuilt.dataset is original.dataset
    assert run_epochs(rebuilt, 2) == run_epochs(make(10, **options), 2)


def test_loader_dataset_attributes_stay_reachable() -> None:
    loader = make(10, shuffle=True)
    assert isinstance(loader.dataset, Augmented) and loader.dataset.n == 10
    assert isinstance(loader, DataLoader) and ids(list(loader))[0] != [0, 1, 2]
    assert torch.is_tensor(next(iter(loader))["torch"])


def test_seed_defaults_to_the_generator_that_would_have_shuffled() -> None:
    dataset = Augmented(10)
    g = torch.Generator().manual_seed(77)
    assert ResumableDataLoader(dataset, generator=g).seed == 77
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(78))
    assert ResumableDataLoader(dataset, sampler=sampler).seed == 78
    assert ResumableDataLoader(dataset, shuffle=True).seed == 0


def test_torch_private_details_we_rely_on_still_hold() -> None:
    """Pins each private torch detail the loader depends on, so a torch upgrade fails here, by
    name."""
    # 1. torch's iterator draws index lists from `loader._index_sampler`, a property we override.
    assert isinstance(inspect.getattr_static(DataLoader, "_index_sampler"), property)
    assert isinstance(inspect.getattr_static(DataLoader, "_auto_collation"), property)
    # 2. keys are applied at the fetch: the single-process iterator fetches right after drawing an
    #    index list (where the main process seeds), and a worker fetches right after unpickling one
    #    (see 4).
    next_data = inspect.getsource(
        torch.utils.data.dataloader._SingleProcessDataLoaderIter._next_data
    )
    lines = [line.strip() for line in next_data.splitlines()[1:] if line.strip()]
    assert lines[:2] == [
        "index = self._next_index()  # may raise StopIteration",
        "data = self._dataset_fetcher.fetch(index)  # may raise StopIteration",
    ], lines
    # 3. the worker base seed is drawn from `loader.generator` while the iterator is built.
    source = inspect.getsource(torch.utils.data.dataloader._BaseDataLoaderIter.__init__)
    assert "random_(generator=loader.generator)" in source
    # 4. between a batch's collate and the next indices a worker runs only its loop, which seeds no
    #    global generator (only IterDataPipe's own `shared_rng`): seeding ahead there is unobserved.
    loop = inspect.getsource(torch.utils.data._utils.worker._worker_loop)
    body = loop[loop.index("while watchdog.is_alive()"):]
    assert re.findall(r"[\w.]*seed\w*\(", body) == ["shared_rng.manual_seed(", "apply_random_seed("]
    calls = ("index_queue.get(", "fetcher.fetch(index)", "data_queue.put((idx, data))")
    assert [body.index(call) for call in calls] == sorted(body.index(call) for call in calls)


def test_a_dataset_that_grows_between_epochs_is_read_whole_next_epoch() -> None:
    """As DataLoader: len() and the next epoch follow the dataset's length at the epoch's start."""
    data = [torch.tensor(i) for i in range(4)]
    loader = ResumableDataLoader(data, batch_size=2, shuffle=True)
    first = sorted(int(x) for batch in loader for x in batch)
    data.append(torch.tensor(4))
    assert len(loader) == 3 and loader.state_dict()["dataset_len"] == 5
    assert first == [0, 1, 2, 3] and sorted(int(x) for batch in loader for x in batch) == [
        0,
        1,
        2,
        3,
        4,
    ]


def test_the_iterator_reaches_torchs_like_dataloaders_does() -> None:
    iterator = iter(make(8, batch_size=2, num_workers=2))
    # torch's own attribute, as DataLoader code and tests read it
    assert len(iterator._workers) == 2
    # DataLoader's answer outside torch's iterator
    assert not make(8, batch_size=None)._auto_collation


def test_a_datapipe_with_a_lambda_reaches_spawned_workers_through_torchs_dill_wrapper() -> None:
    """DataLoader wraps a datapipe so that spawned workers unpickle it with dill; the wrapped one is
    what we send."""
    # HF datasets, a test dependency, requires it; torch uses it when present
    import dill  # noqa: F401
    from torch.utils.data.datapipes.iter import IterableWrapper

    pipe = IterableWrapper([[1, 2], [3, 4, 5], [6, 7]]).filter(lambda row: len(row) == 2)
    batches = ResumableDataLoader(
        pipe, batch_size=None, num_workers=1, multiprocessing_context="spawn"
    )
    assert list(batches) == [[1, 2], [6, 7]]
