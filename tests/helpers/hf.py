"""Editing a saved Hugging Face folder and reading `import_hf`'s refusal, for the HF interop tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optimus.models.hf import InteropError, import_hf


def edit_hf_config(path: Path, **changes) -> None:
    """Rewrite config.json in `path` with `changes` (a value of `...` drops the key)."""
    hf = json.loads((path / "config.json").read_text())
    hf.update(changes)
    (path / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not ...}))


def hf_import_error(path: Path) -> str:
    """The one-line message `import_hf(path)` refuses with."""
    with pytest.raises(InteropError) as err:
        import_hf(path)
    assert "\n" not in str(err.value)
    return str(err.value)
