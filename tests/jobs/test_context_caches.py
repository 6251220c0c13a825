"""The loaded models a process keeps belong to its Context (``ctx.caches.models`` and ``.variants``,
:class:`service.context.LoadedCache`), not to module globals: sized from the context's settings,
shared by a copy of the context, never by another context, and room is made before a load.

The cached objects here are small stand-ins; whether one is still alive is read through a weak
reference, independently of the cache's own bookkeeping.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
import weakref
from collections.abc import Callable

from service.context import Context, LoadedCache


class Loaded:
    """A stand-in for a loaded model (weakly referenceable, unlike a tuple)."""

    def __init__(self, name: str) -> None:
        self.name = name


def test_the_context_sizes_its_model_cache_from_its_settings(context_with: Callable[..., Context]) -> None:
    ctx = context_with(model_cache_size=3)
    assert ctx.caches.models.capacity == 3
    assert ctx.caches.variants.capacity == 1, "one variant at a time: a model-sized object each"


def test_a_copy_of_a_context_shares_its_caches_another_context_does_not(context_with: Callable[..., Context]) -> None:
    first, other = context_with(), context_with()
    inline = dataclasses.replace(first, dispatch=lambda job: None)  # as a calibration's inline context
    kept = first.caches.models.get_or_load("m", lambda: Loaded("m"))
    assert inline.caches.models.get_or_load("m", lambda: Loaded("again")) is kept
    assert other.caches.models.get_or_load("m", lambda: Loaded("other")).name == "other"


def test_room_is_made_before_the_next_load() -> None:
    cache: LoadedCache[Loaded] = LoadedCache(1)
    first = weakref.ref(cache.get_or_load("a", lambda: Loaded("a")))
    alive_while_loading: list[bool] = []

    def load_b() -> Loaded:
        alive_while_loading.append(first() is not None)
        return Loaded("b")

    assert cache.get_or_load("b", load_b).name == "b"
    assert alive_while_loading == [False], "the first model was dropped before the second loaded"
    assert cache.keys() == ["b"]


def test_a_hit_loads_nothing_and_keeps_the_most_recently_used() -> None:
    cache: LoadedCache[Loaded] = LoadedCache(2)
    a = cache.get_or_load("a", lambda: Loaded("a"))
    cache.get_or_load("b", lambda: Loaded("b"))
    assert cache.get_or_load("a", lambda: Loaded("reloaded")) is a
    cache.get_or_load("c", lambda: Loaded("c"))  # drops b, the least recently used
    assert cache.keys() == ["a", "c"]


def test_a_job_may_resize_its_contexts_cache(context_with: Callable[..., Context]) -> None:
    ctx = context_with(model_cache_size=3)
    for name in "abc":
        ctx.caches.models.get_or_load(name, functools.partial(Loaded, name))
    ctx.caches.models.resize(1)
    assert ctx.caches.models.keys() == ["c"]
    assert context_with(model_cache_size=3).caches.models.capacity == 3, "another context keeps its size"


def test_two_jobs_asking_for_one_model_load_it_once() -> None:
    cache: LoadedCache[Loaded] = LoadedCache(1)
    loads: list[str] = []

    def slow_load() -> Loaded:
        loads.append("m")
        time.sleep(0.2)  # the second ask arrives while the first loads
        return Loaded("m")

    got: list[Loaded] = []
    threads = [threading.Thread(target=lambda: got.append(cache.get_or_load("m", slow_load))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert loads == ["m"] and len(got) == 2 and got[0] is got[1]
