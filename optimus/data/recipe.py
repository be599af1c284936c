"""Mixture recipes: a YAML file naming a published mix's sources, token counts and usual file layout.

A recipe (e.g. configs/data/olmoe-mix-0924.yaml) turns into the `data.sources` list a config would
otherwise spell out: each source becomes a `glob` of token files under `data.root` (or at
`data.paths[source]`), weighted by its published token count unless `data.weights[source]` says
otherwise (0 leaves the source out).
"""

from __future__ import annotations

import glob as globbing
from pathlib import Path

from pydantic import ValidationError

from optimus.data.config import DataConfig, DataSource
from optimus.data.errors import DataError

# Recipes ship in the repository's configs/data/; a bare relative path is also looked up there.
_REPO_ROOT = Path(__file__).resolve().parents[2]


def _recipe_file(spec: str) -> Path:
    path = Path(spec).expanduser()
    for candidate in (path, _REPO_ROOT / path):
        if candidate.is_file():
            return candidate
    raise DataError(f"data.recipe {spec} not found: give the path of a recipe file, e.g. configs/data/olmoe-mix-0924.yaml")


def load_recipe(spec: str) -> dict:
    """The parsed recipe file: {"name", "dtype", "eos_id", "sources": {name: {"tokens", "path", ...}}}."""
    path = _recipe_file(spec)
    from optimus.config import YamlFileError, read_yaml  # here: optimus.config imports the data package

    try:
        recipe = read_yaml(path)
    except YamlFileError as error:
        raise DataError(f"recipe {path} {error}") from None
    sources = recipe.get("sources") if isinstance(recipe, dict) else None
    if not isinstance(sources, dict) or not sources:
        raise DataError(f"recipe {path} has no 'sources' mapping: list each source with its tokens and path")
    for name, entry in sources.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise DataError(f"recipe {path}: source {name!r} needs a 'path' (a glob relative to data.root)")
        # PyYAML reads "3.86e12" (no sign in the exponent) as a string, so token counts are converted here.
        try:
            entry["tokens"] = None if entry.get("tokens") is None else float(entry["tokens"])
        except (TypeError, ValueError):
            raise DataError(f"recipe {path}: source {name!r} has tokens {entry['tokens']!r}: write a number like 3.86e12") from None
    return recipe


def _source_glob(name: str, entry: dict, data: DataConfig) -> str:
    """Where source `name`'s files are: data.paths[name] as given, else data.root / the recipe's path."""
    if name in data.paths:
        pattern = data.paths[name]
    elif data.root is not None:
        pattern = str(Path(data.root).expanduser() / entry["path"])
    else:
        raise DataError(f"source {name} of the recipe has no location: set data.root (expects <root>/{entry['path']})")
    if not globbing.glob(str(Path(pattern).expanduser()), recursive=True):
        raise DataError(
            f"source {name}: no files at {pattern}: copy them there, set data.paths.{name}, "
            f"or leave the source out with data.weights.{name}: 0"
        )
    return pattern


def recipe_sources(data: DataConfig) -> list[DataSource]:
    """The sources that `data.recipe` names, located and weighted as the module docstring says."""
    recipe = load_recipe(data.recipe)
    unknown = sorted((set(data.paths) | set(data.weights)) - set(recipe["sources"]))
    if unknown:
        raise DataError(
            f"data.paths/data.weights name {', '.join(unknown)}, not in recipe {data.recipe}: "
            f"use one of {', '.join(recipe['sources'])}"
        )
    sources = []
    for name, entry in recipe["sources"].items():
        weight = data.weights.get(name, entry.get("tokens"))
        if weight is None:
            raise DataError(
                f"source {name} of recipe {data.recipe} has no token count: set data.weights.{name} "
                f"(its tokens, like the others) or data.weights.{name}: 0 to leave it out"
            )
        if float(weight) < 0:
            raise DataError(f"data.weights.{name} is {weight}: use a non-negative weight (0 leaves the source out)")
        if float(weight) == 0:
            continue
        dtype, eos_id = entry.get("dtype", recipe.get("dtype")), entry.get("eos_id", recipe.get("eos_id"))
        try:
            source = DataSource(glob=_source_glob(name, entry, data), weight=float(weight), dtype=dtype, eos_id=eos_id)
        except ValidationError:
            raise DataError(
                f"recipe {data.recipe}: source {name} has dtype {dtype!r} / eos_id {eos_id!r}: "
                "use dtype uint16 or uint32 (or null) and a non-negative eos_id (or null)"
            ) from None
        sources.append(source)
    if not sources:
        raise DataError(f"every source of recipe {data.recipe} has weight 0: give at least one a positive weight")
    return sources
