"""The global generators' states as memory: copied, compared and put back in well under a
microsecond each.

A keyed fetch in the main process must leave the caller's generators as they were, and must know
whether the dataset drew from a generator it did not key
(``loader_resume.keyed.keyed_fetch.KeyedFetch``). The public APIs copy a whole state into Python
objects (torch ``get_state``/``set_state`` ~1.5 µs a pair, numpy's legacy
``get_state``/``set_state`` ~50 µs, ``random.getstate``/``setstate`` ~9 µs). Each of the three is an
MT19937 whose state lies in one block of memory, so a state is taken as ``bytes`` of that block,
compared with ``==`` and written back, through a ``memoryview`` made once per process:

- torch: ``CPUGeneratorImpl``'s engine (seed, counters, 624 words) and its two cached normal
  samples;
- numpy: the ``MT19937`` bit generator's ``state_address`` struct, and ``RandomState``'s cached
  Gaussian;
- ``random``: CPython's ``RandomObject`` (index and 624 words) and ``gauss_next``.

NOTE: torch's and numpy's block offsets are found by a probe on a private generator of the same
class, checked against the public API (values, a round trip, a cached normal) once per process;
where any check fails, that generator falls back to its public API (slower, same values).
"""

from __future__ import annotations

import ctypes
import logging
import random
import struct
import sys
from typing import Any, Final

import numpy as np
import torch

from loader_resume.keyed.rng_api import PublicApi, numpy_api, random_api, torch_api

__all__ = ["GENERATORS", "GeneratorStates", "generator_states"]

logger = logging.getLogger(__name__)

GENERATORS: Final = ("torch", "numpy", "random")
"""The keyed global generators, in bit order (1, 2, 4)."""
_MT_WORDS: Final = 624
# seed_, left_, seeded_ (padded), next_, state_[624]
_TORCH_ENGINE_BYTES: Final = 8 + 4 + 4 + 4 + 4 * _MT_WORDS
# optional<float>, padding, optional<double>
_TORCH_BLOCK_BYTES: Final = _TORCH_ENGINE_BYTES + 8 + 4 + 16
_NP_STATE_BYTES: Final = 4 * _MT_WORDS + 4  # mt19937_state: uint32 key[624]; int pos
# RandomObject after PyObject_HEAD: int index; uint32 state[624]
_RANDOM_STATE_BYTES: Final = 4 + 4 * _MT_WORDS


def _view(address: int, size: int) -> memoryview:
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


class _Block:
    """A generator whose state is one block of memory (``extra``: a second block, e.g. a cached
    normal)."""

    __slots__ = ("_cells", "extra", "main", "owner")

    def __init__(
        self, main: memoryview, extra: memoryview | None, owner: Any, marks: list[int]
    ) -> None:
        self.main, self.extra = main, extra
        self.owner = owner
        """The object the blocks belong to (kept alive; compared to find a replaced numpy bit
        generator)."""
        self._cells = [ctypes.c_uint64.from_address(address) for address in marks]

    def marks(self) -> Any:
        """A few words of the blocks that change whenever the generator does: MT19937's position
        counter and the state words next to it (a draw moves the counter; a whole number of refills
        of the 624 words, which leaves it where it was, replaces the words), and the cached normals'
        flags. ~10 cache lines read instead of the whole state: what a worker's fetch compares (it
        keeps no copy of the states)."""
        return tuple([cell.value for cell in self._cells])

    def take(self) -> Any:
        return bytes(self.main) if self.extra is None else (bytes(self.main), bytes(self.extra))

    def put(self, taken: Any) -> None:
        if self.extra is None:
            self.main[:] = taken
        else:
            self.main[:], self.extra[:] = taken


class _RandomBlock(_Block):
    """``random``: the MT19937 struct, and ``gauss_next`` (a Python attribute of the shared
    instance)."""

    __slots__ = ()

    def take(self) -> Any:
        return bytes(self.main), random._inst.gauss_next  # type: ignore[attr-defined]

    def marks(self) -> Any:
        gauss_next = random._inst.gauss_next  # type: ignore[attr-defined]
        return (*[cell.value for cell in self._cells], gauss_next)

    def put(self, taken: Any) -> None:
        self.main[:], random._inst.gauss_next = taken  # type: ignore[attr-defined]


def _torch_block() -> _Block | None:
    """torch's default CPU generator as memory, or None when its layout is not the one probed
    for."""
    if sys.implementation.name != "cpython":
        return None
    probe, seed = torch.Generator(), 0x5EED_1234_ABCD_0077
    probe.manual_seed(seed)
    # THPGenerator: head; Generator
    impl = ctypes.c_void_p.from_address(id(probe) + object.__basicsize__).value
    if not impl:
        return None
    offset = ctypes.string_at(impl, 512).find(struct.pack("<QiB", seed, 1, 1))
    if offset < 0:
        return None

    def block(generator: torch.Generator) -> _Block:
        address = ctypes.c_void_p.from_address(id(generator) + object.__basicsize__).value
        assert address is not None
        engine = address + offset
        # next_ and state_[0]; state_[1..2]; optional<float> (value, flag); optional<double>'s flag
        marks = [
            engine + 16,
            engine + 24,
            engine + _TORCH_ENGINE_BYTES,
            engine + _TORCH_ENGINE_BYTES + 20,
        ]
        return _Block(_view(engine, _TORCH_BLOCK_BYTES), None, generator, marks)

    def words(view: _Block) -> tuple[int, ...]:
        return struct.unpack_from(f"<{_MT_WORDS}I", view.take(), 20)

    # CPUGeneratorImplState's legacy pod
    def serialized_words(generator: torch.Generator) -> tuple[int, ...]:
        serialized = generator.get_state().numpy().tobytes()
        return tuple(w & 0xFFFFFFFF for w in struct.unpack_from(f"<{_MT_WORDS}Q", serialized, 24))

    mine = block(probe)
    if words(mine) != serialized_words(probe):
        return None
    torch.randn(1, generator=probe)  # a pair drawn, one normal cached
    taken, marks, state = mine.take(), mine.marks(), probe.get_state()
    # the cached normal consumed: the engine does not move, the block must
    torch.randn(1, generator=probe)
    if mine.take() == taken or mine.marks() == marks:
        return None
    torch.rand(1000, generator=probe)
    mine.put(taken)
    again = torch.Generator().set_state(state)
    if not torch.equal(probe.get_state(), state) or not torch.equal(
        torch.randn(3, generator=probe), torch.randn(3, generator=again)
    ):
        return None
    default = block(torch.default_generator)
    return default if words(default) == serialized_words(torch.default_generator) else None


def _numpy_block() -> _Block | None:
    """numpy's legacy global ``RandomState`` as memory (its MT19937 struct and cached Gaussian), or
    None."""
    state = np.random.mtrand._rand
    bit_generator = state._bit_generator
    if type(bit_generator).__name__ != "MT19937" or sys.implementation.name != "cpython":
        return None
    probe = np.random.RandomState(np.random.MT19937(5))
    probe.normal()  # a Gaussian cached: find has_gauss (int) and gauss (double) in the object
    legacy: Any = probe.get_state()
    _, _, _, has_gauss, gauss = legacy
    head = ctypes.string_at(id(probe), type(probe).__basicsize__)
    offset = head.find(struct.pack("<i4xd", has_gauss, gauss))
    if has_gauss != 1 or offset < 0:
        return None

    def block(random_state: Any, mt19937: Any) -> _Block:
        key, aug = int(mt19937.ctypes.state_address), id(random_state) + offset
        # key[0..1]; key[623] and pos; has_gauss
        return _Block(
            _view(key, _NP_STATE_BYTES),
            _view(aug, 16),
            mt19937,
            [key, key + _NP_STATE_BYTES - 8, aug],
        )

    mine = block(probe, probe._bit_generator)
    taken, marks = mine.take(), mine.marks()
    probe.normal()  # consumed: the MT19937 does not move, the block must
    legacy = probe.get_state()
    if mine.take() == taken or mine.marks() == marks or legacy[3] != 0:
        return None
    probe.random(1000)
    mine.put(taken)
    legacy = probe.get_state()
    if legacy[2:] != (legacy[2], has_gauss, gauss) or probe.normal() != gauss:
        return None
    return block(state, bit_generator)


def _random_block() -> _Block | None:
    """``random``'s shared instance as memory, or None when this interpreter lays it out
    otherwise."""
    instance = random._inst
    if type(instance) is not random.Random or sys.implementation.name != "cpython":
        return None
    address = id(instance) + object.__basicsize__  # PyObject_HEAD: refcount and type pointer
    index, *words = struct.unpack("i624I", ctypes.string_at(address, _RANDOM_STATE_BYTES))
    version, internal, _ = random.getstate()
    if version != 3 or (*words, index) != internal:
        return None
    # index and state[0]; state[1..2]
    return _RandomBlock(_view(address, _RANDOM_STATE_BYTES), None, instance, [address, address + 8])


class GeneratorStates:
    """The keyed global generators of this process, in bit order (1 torch, 2 numpy, 4 ``random``).

    ``take`` copies their whole states, one ``bytes`` per generator where its state is a block of
    memory (the usual case, ~0.2 µs each); ``changed`` compares them, ``put`` writes them back.
    """

    __slots__ = ("_generators", "_numpy_owner")

    def __init__(self) -> None:
        blocks = _torch_block(), _numpy_block(), _random_block()
        fallbacks = [name for name, block in zip(GENERATORS, blocks, strict=True) if block is None]
        if fallbacks:
            logger.info(
                "generator states through the public API (slower) for %s: layout not as probed",
                fallbacks,
            )
        self._generators: tuple[_Block | PublicApi, ...] = (
            blocks[0] or torch_api(), blocks[1] or numpy_api(), blocks[2] or random_api())
        self._numpy_owner = blocks[1].owner if blocks[1] is not None else None

    def take(self) -> tuple[Any, ...]:
        """The three generators' whole states."""
        self._follow_numpy()
        torch_state, numpy_state, random_state = self._generators
        return torch_state.take(), numpy_state.take(), random_state.take()

    def marks(self, among: int) -> tuple[Any, ...]:
        """The marks (``_Block.marks``) of the generators of ``among``: equal marks before and after
        a fetch mean the generators did not move (different ones are confirmed by ``changed``)."""
        self._follow_numpy()
        return tuple(
            [generator.marks() for i, generator in enumerate(self._generators) if among >> i & 1]
        )

    def _follow_numpy(self) -> None:
        if (
            self._numpy_owner is not None
            and self._numpy_owner is not np.random.mtrand._rand._bit_generator
        ):
            # np.random.set_bit_generator replaced numpy's: probe again
            self.__init__()  # type: ignore[misc]

    def moved(self, marks: tuple[Any, ...], among: int) -> int:
        """The generators of ``among`` whose marks are no longer ``marks`` (taken by ``marks`` with
        the same ``among``): marks are words of a state, so these have moved."""
        out, j = 0, 0
        for i, generator in enumerate(self._generators):
            if among >> i & 1:
                if generator.marks() != marks[j]:
                    out |= 1 << i
                j += 1
        return out

    def changed(self, taken: tuple[Any, ...], among: int) -> int:
        """The generators of ``among`` whose state is no longer the one ``taken``."""
        out = 0
        for i, generator in enumerate(self._generators):
            if among >> i & 1 and generator.take() != taken[i]:
                out |= 1 << i
        return out

    def put(self, taken: tuple[Any, ...], only: int) -> None:
        """Put the generators of ``only`` back to their states in ``taken``."""
        for i, generator in enumerate(self._generators):
            if only >> i & 1:
                generator.put(taken[i])


_STATES: GeneratorStates | None = None


def generator_states() -> GeneratorStates:
    """This process's ``GeneratorStates`` (probed on first use; a fork inherits the same
    addresses)."""
    global _STATES
    if _STATES is None:
        _STATES = GeneratorStates()
    return _STATES
