"""The callback interface: side concerns (console, files, plots) hook into the loop here."""

from __future__ import annotations

from typing import Any


class Callback:
    """Override what you need; every hook is a no-op by default. Only rank 0 gets callbacks."""

    def on_train_start(self, start_step: int, max_steps: int) -> None: ...

    def on_step_start(self, step: int) -> None: ...

    def on_step_end(self, step: int, metrics: dict[str, Any]) -> None: ...

    def on_eval(self, step: int, metrics: dict[str, Any]) -> None: ...

    def on_checkpoint(self, step: int) -> None: ...

    def on_train_end(self, step: int) -> None: ...
