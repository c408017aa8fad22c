"""Wall-clock timing of a step's stages (``timing_s/<stage>``), shared by every program."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StageTimer:
    """Wall-clock seconds per named stage: ``with timer("gen"): ...`` -> ``timing_s/gen``."""

    def __init__(self, on_enter=None) -> None:
        self.seconds: dict[str, float] = {}
        self.on_enter = on_enter  # called with the stage name as it starts

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if self.on_enter is not None:
            self.on_enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{name}": s for name, s in self.seconds.items()}
