"""`optimus bench [NAME [ARGS...]]`: the scripts of a source checkout's benchmarks/ folder, listed, or one run by name.

The benchmarks are not part of the installed package (they compare against references that need the test
helpers, transformers and the configs/ folder), so this verb finds them beside the package, in the checkout an
editable install (`pip install -e .`, what `make` does) runs from. A script runs in the checkout's root, where its
default paths (configs/, benchmarks/results/) are, with the checkout on PYTHONPATH and the environment its own usage
line asks for (`OMP_NUM_THREADS=1 python benchmarks/NAME.py`: one thread per rank) unless the caller set it.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from optimus.cli.errors import BENCH_PROG_VARIABLE, EXIT_BAD_INPUT

CHECKOUT = Path(__file__).resolve().parents[2]
USAGE = "optimus bench [NAME [the script's own arguments...]]"


@dataclass(frozen=True)
class Benchmark:
    """One script of benchmarks/: its name (the file's stem), what it compares, and the environment its usage line
    sets before the command (PYTHONPATH=., OMP_NUM_THREADS=1...)."""

    name: str
    path: Path
    summary: str
    environment: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        return [sys.executable, str(self.path)] if self.path.suffix == ".py" else ["bash", str(self.path)]


def find_benchmarks(folder: Path) -> dict[str, Benchmark]:
    """The runnable scripts of `folder` by name: Python files (not the `_`-prefixed helpers) and shell scripts, each
    described by its docstring's or its header comment's first line. Nothing is imported or run to read them."""
    found = {}
    for path in sorted(folder.glob("*.py")) + sorted(folder.glob("*.sh")):
        if path.name.startswith("_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        description = _docstring(text) if path.suffix == ".py" else _header_comment(text)
        found[path.stem] = Benchmark(path.stem, path, _first_sentence(description),
                                     _usage_environment(description, path))
    return found


def _first_sentence(description: str, longest: int = 160) -> str:
    """The first sentence of a description's opening paragraph, on one line, cut at a word to `longest` characters."""
    paragraph = " ".join(description.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0].rstrip(".:")
    return sentence if len(sentence) <= longest else sentence[:longest - 3].rsplit(" ", 1)[0] + "..."


def _docstring(source: str) -> str:
    try:
        return ast.get_docstring(ast.parse(source)) or ""
    except SyntaxError:
        return ""


def _header_comment(source: str) -> str:
    """A shell script's opening comment block (after the #! line), without the #s."""
    lines = []
    for line in source.splitlines():
        if line.startswith("#!"):
            continue
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return "\n".join(lines)


def _usage_environment(description: str, path: Path) -> dict[str, str]:
    """The VAR=VALUE words before `python` on the description's first line that runs this script: what the script
    needs set (PYTHONPATH=. is the checkout, which every script gets anyway)."""
    for line in description.splitlines():
        words = line.split()
        if not any(word.endswith(f"benchmarks/{path.name}") for word in words):
            continue
        assignments = []
        for word in words:
            if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", word):
                break
            assignments.append(word.split("=", 1))
        return {name: value for name, value in assignments if name != "PYTHONPATH"}
    return {}


def listing(benchmarks: Mapping[str, Benchmark]) -> str:
    """What `optimus bench` prints: one line a script."""
    width = max((len(name) for name in benchmarks), default=0)
    lines = [f"usage: {USAGE}", f"benchmarks in {CHECKOUT / 'benchmarks'} (each prints a table and writes JSON; "
             "`optimus bench NAME --help` for its flags):"]
    lines += [f"  {b.name:<{width}}  {b.summary}" for b in benchmarks.values()]
    return "\n".join(lines)


def run_bench(argv: list[str], folder: Path | None = None) -> int:
    """The `bench` verb: list the benchmarks (no NAME, or --help), or run NAME with the rest of argv as its own
    arguments; returns the exit code (the script's, or 2 with one line for a name or checkout that is not there)."""
    folder = CHECKOUT / "benchmarks" if folder is None else folder
    if not folder.is_dir():
        print(f"optimus bench: error: no benchmarks/ folder beside the installed package ({folder} is missing): the "
              "benchmarks ship with the source checkout; clone the repository and install it with `pip install -e .`",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    benchmarks = find_benchmarks(folder)
    if not argv or argv[0] in ("-h", "--help"):
        print(listing(benchmarks))
        return 0
    name, args = argv[0], argv[1:]
    if name.endswith((".py", ".sh")):  # `optimus bench moe_layer.py` means the script of that file
        name = name[:-3]
    chosen = benchmarks.get(name)
    if chosen is None:
        close = difflib.get_close_matches(name, benchmarks, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"optimus bench: error: no benchmark named {argv[0]!r}: {hint}choose one of {', '.join(benchmarks)} "
              "(`optimus bench` lists them)", file=sys.stderr)
        return EXIT_BAD_INPUT
    environment = dict(os.environ)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder.parent), environment.get("PYTHONPATH")]))
    for variable, value in chosen.environment.items():
        environment.setdefault(variable, value)
    environment[BENCH_PROG_VARIABLE] = f"{chosen.path.name}:optimus bench {name}"
    try:
        code = subprocess.run([*chosen.command(), *args], cwd=folder.parent, env=environment).returncode
    except KeyboardInterrupt:
        print(f"optimus bench {name}: interrupted", file=sys.stderr)
        return 130
    return 128 - code if code < 0 else code  # a script a signal ended exits as a shell reports it (SIGKILL: 137)
