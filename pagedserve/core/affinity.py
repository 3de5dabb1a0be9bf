"""The routing rule shared by the data-parallel replicas (engine/data_parallel.py) and `pagedserve router`
(entrypoints/router.py): the least loaded candidate (ties taken in turn), except that a prompt whose
prefix key was routed before goes to that key's home again while the home's load is within `slack` of
the least loaded one — its prefix cache likely holds the prefix. Homes are remembered least recently
used first out, at most `max_prefixes` of them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T")


class PrefixAffinity(Generic[T]):
    def __init__(self, slack: float, max_prefixes: int) -> None:
        self.slack = slack
        self.max_prefixes = max_prefixes
        self._home: OrderedDict[Hashable, T] = OrderedDict()
        self._turn = 0

    def choose(self, candidates: Sequence[T], load: Callable[[T], float], position: Callable[[T], int],
               num_all: int, key: Hashable | None) -> T:
        """candidates: the live ones (non-empty); position: a candidate's index among all `num_all` (for
        the turn order of ties); key: the prompt's prefix key, None for none."""
        turn = self._turn
        self._turn += 1
        least = min(candidates, key=lambda c: (load(c), (position(c) - turn) % num_all))
        if key is None:
            return least
        home = self._home.get(key)
        if home is not None and home in candidates and load(home) <= load(least) + self.slack:
            self._home.move_to_end(key)
            return home
        self._home[key] = least
        self._home.move_to_end(key)
        if len(self._home) > self.max_prefixes:
            self._home.popitem(last=False)
        return least
