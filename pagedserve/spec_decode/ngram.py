"""N-gram prompt lookup (vLLM's `ngram` method): the next tokens are guessed from the sequence itself.

If the sequence's last n tokens (n from prompt_lookup_max down to prompt_lookup_min) occurred earlier in
the prompt or the output, the tokens that followed that occurrence are proposed: those after its most
recent occurrence, or, when fewer than k tokens follow that one (a short loop), after its first.
Text that copies its input (edits, rewrites, code, quoting) is where this pays. The proposal is
deterministic, which the rejection sampler relies on.

Each request keeps an index per n: n-gram → the position right after its first and its latest occurrence,
extended by the tokens added since the last lookup, so a lookup costs O(prompt_lookup_max) however long
the sequence is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.core.request import Request


@dataclass(slots=True)
class _NgramIndex:
    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    first: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)
    upto: int = 0  # positions i < upto are indexed (the n-gram ending just before token i)


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        self.n_min, self.n_max = prompt_lookup_min, prompt_lookup_max
        self._index: dict[str, _NgramIndex] = {}

    def propose(self, batch: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """batch: (request, most tokens to propose) → request id → its proposal (only those with one)."""
        out = {}
        for req, k in batch:
            draft = self.lookup(req.request_id, req.all_token_ids, k)
            if draft:
                out[req.request_id] = draft
        return out

    def lookup(self, key: str, tokens: list[int], k: int) -> list[int]:
        idx = self._index.get(key)
        if idx is None:
            ns = range(self.n_min, self.n_max + 1)
            idx = self._index[key] = _NgramIndex({n: {} for n in ns}, {n: {} for n in ns})
        length = len(tokens)
        # Index the n-grams that end before the last token (an occurrence must have a token after it;
        # the sequence's own suffix is never its own match).
        for n, latest in idx.latest.items():
            first = idx.first[n]
            for i in range(max(n, idx.upto), length):
                gram = tuple(tokens[i - n : i])
                latest[gram] = i
                first.setdefault(gram, i)
        idx.upto = max(idx.upto, length)
        for n in range(self.n_max, self.n_min - 1, -1):
            if length <= n:
                continue
            gram = tuple(tokens[length - n :])
            j = idx.latest[n].get(gram)
            if j is not None:
                if j + k > length:
                    j = idx.first[n][gram]
                return tokens[j : j + k]
        return []

    def on_verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        pass  # nothing to roll back: the index only holds real tokens

    def drop(self, request_id: str) -> None:
        self._index.pop(request_id, None)
