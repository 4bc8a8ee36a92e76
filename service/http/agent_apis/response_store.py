"""The responses ``/v1/responses`` keeps for ``previous_response_id``: a bounded, least-recently-used map in memory.

Each entry is the conversation as items (the inputs that led to it, then its own output), so that continuing it
is appending the next input. The store is per process and lost on restart; a client naming a response it no longer
holds gets a 404 that says so (``--responses-store-size`` sets how many are kept).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from service.errors import NotFoundError


class ResponseStore:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, list[dict[str, Any]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response_id: str, items: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[response_id] = items
            self._items.move_to_end(response_id)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        """The items of a stored response's conversation; a 404 naming the id when it is not (or no longer) kept."""
        with self._lock:
            items = self._items.get(response_id)
            if items is not None:
                self._items.move_to_end(response_id)
        if items is None:
            raise NotFoundError(
                f"previous_response_id {response_id!r} is not stored on this server (never created here, sent with "
                f"store=false, or dropped: it keeps the last {self.capacity} responses, --responses-store-size); "
                "send the whole conversation as input instead.",
                code="previous_response_not_found",
            )
        return list(items)

    def __len__(self) -> int:
        return len(self._items)
