"""Bad input: one clear line on stderr, exit code 2, no traceback, nothing good overwritten."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from optimus.cli import main
from tests.e2e.conftest import run_cli, tiny_config, train_tiny_run


def fail_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def snapshot(run_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(run_dir.rglob("*")) if p.is_file() and p.name != "metrics.jsonl"
    }


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_config_mistakes(capsys, tmp_path, token_dir):
    cfg = write(tmp_path, tiny_config(token_dir))
    assert "unknown config key 'train.max_step'" in fail_line(capsys, ["train", cfg, "--train.max_step=3"])
    assert "unknown model.preset" in fail_line(capsys, ["train", cfg, "--model.preset=gpt-9"])
    assert "not found" in fail_line(capsys, ["train", str(tmp_path / "nope.yaml")])
    assert "bad value for 'optim.lr'" in fail_line(capsys, ["train", cfg, "--optim.lr=fast"])
    assert "should be a finite number" in fail_line(capsys, ["train", cfg, "--optim.lr=inf"])
    assert "world size" in fail_line(capsys, ["train", cfg, "--parallel.dp_shard=2"])
    assert "not divisible by train.micro_batch_size (4)" in fail_line(capsys, ["train", cfg, "--parallel.dp_shard=4"])


def test_data_mistakes(capsys, tmp_path, token_dir):
    missing = tiny_config(token_dir, data={"sources": [{"path": str(tmp_path / "absent")}]})
    assert "absent" in fail_line(capsys, ["train", write(tmp_path, missing), f"--run.dir={tmp_path / 'r'}"])

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "train.bin").write_bytes(b"")
    meta = {"dtype": "uint16", "tokens": 0, "documents": 0, "tokenizer_sha256": "x", "eos_id": 50279, "vocab_size": 50280}
    (empty / "train.json").write_text(yaml.safe_dump(meta))
    no_tokens = tiny_config(token_dir, data={"sources": [{"path": str(empty)}]})
    fail_line(capsys, ["train", write(tmp_path, no_tokens), f"--run.dir={tmp_path / 'r'}"])

    small_vocab = tiny_config(token_dir)
    err = fail_line(capsys, ["train", write(tmp_path, small_vocab), "--model.vocab_size=1000", f"--run.dir={tmp_path / 'r'}"])
    assert "vocab" in err
    assert not (tmp_path / "r" / "checkpoints").exists()


def test_damaged_or_foreign_checkpoint_is_refused_and_kept(capsys, tmp_path, token_dir):
    run = tmp_path / "run"
    cfg = write(tmp_path, tiny_config(token_dir, train={"max_steps": 2, "ckpt_every": 2, "eval_every": 0}))
    assert main(["train", cfg, f"--run.dir={run}", "--no-progress"]) == 0
    capsys.readouterr()
    before = snapshot(run)

    err = fail_line(capsys, ["train", cfg, f"--run.dir={run}", "--train.max_steps=4", "--model.d_model=128"])
    assert "different model" in err and "d_model" in err
    assert snapshot(run) == before

    # a max_steps below the checkpoint's step trained nothing, said nothing and rewrote config.yaml to it
    err = fail_line(capsys, ["train", cfg, f"--run.dir={run}", "--train.max_steps=1"])
    assert "at step 2, past train.max_steps = 1: pass --train.max_steps=2 or more" in err
    assert snapshot(run) == before

    shard = next((run / "checkpoints" / "step-2").glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    before = snapshot(run)
    err = fail_line(capsys, ["train", cfg, f"--run.dir={run}", "--train.max_steps=4"])
    assert "damaged" in err and "step-2" in err
    assert snapshot(run) == before
    assert fail_line(capsys, ["generate", str(run), "--prompt", "Hello"])


@pytest.mark.parametrize("name", ["metrics.jsonl", "loss.png"])
def test_a_folder_where_training_writes_a_file_is_refused_before_training(capsys, tmp_path, token_dir, name):
    """A folder named loss.png passed the pre-start checks and failed at the first checkpoint, after training and
    after older checkpoints were rotated out; metrics.jsonl failed after loss.png was redrawn empty."""
    run = tmp_path / "run"
    (run / name).mkdir(parents=True)
    cfg = write(tmp_path, tiny_config(token_dir, train={"max_steps": 2, "ckpt_every": 2, "eval_every": 0}))
    err = fail_line(capsys, ["train", cfg, f"--run.dir={run}", "--no-progress"])
    assert f"holds a folder named '{name}' where training writes a file: move it away" in err
    assert sorted(p.name for p in run.iterdir()) == [name]


def test_run_dir_mistakes(capsys, tmp_path):
    assert "not a run directory" in fail_line(capsys, ["eval", str(tmp_path)])
    assert "not a run directory" in fail_line(capsys, ["export", str(tmp_path), "--format", "hf", "--out", str(tmp_path / "o")])


def test_subprocess_error_has_no_traceback(tmp_path):
    result = run_cli("train", str(tmp_path / "missing.yaml"))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------------------
# Run directories, checkpoints and Hugging Face folders that cannot be used: a table of cases, each run
# through the CLI; every one must end with exit 2, one line, no traceback, and name the problem.


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_dir) -> tuple[Path, Path]:
    """(config, run dir) of a 2-step tiny run with one checkpoint, step-2."""
    return train_tiny_run(tmp_path_factory.mktemp("trained"), token_dir, max_steps=2)


def _train(cfg: Path, run: Path) -> list[str]:
    return ["train", str(cfg), f"--run.dir={run}", "--train.max_steps=4", "--no-progress"]


def _copy(trained, tmp: Path) -> Path:
    shutil.copytree(trained[1], tmp / "run")
    return tmp / "run"


def _garbled_index(trained, tmp: Path) -> Path:
    """A corrupt DCP index whose manifest was rewritten to match (so only loading can find out)."""
    from tests.unit.checkpoint.tampering import reseal

    run = _copy(trained, tmp)
    index = run / "checkpoints" / "step-2" / ".metadata"
    index.write_bytes(index.read_bytes()[:100])
    reseal(index.parent)
    return run


def _hf_folder(tmp: Path, config: object = None, weights: bytes | None = None, index: str | None = None) -> Path:
    from safetensors.torch import save_file

    from optimus.models.config import ModelConfig
    from optimus.models.hf import hf_config

    folder = tmp / "hf"
    folder.mkdir()
    model = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_experts=2, top_k=1, expert_ffn_hidden=16, vocab_size=64)
    (folder / "config.json").write_text(json.dumps(hf_config(model, "olmoe") if config is None else config))
    save_file({"model.embed_tokens.weight": torch.zeros(64, 32)}, str(folder / "model.safetensors"))
    if weights is not None:
        data = (folder / "model.safetensors").read_bytes()
        (folder / "model.safetensors").write_bytes(data[: len(data) // 2] if weights == b"truncate" else weights)
    if index is not None:
        (folder / "model.safetensors.index.json").write_text(index)
    return folder


def _file(tmp: Path) -> Path:
    """A plain file where a command's output folder would go."""
    (tmp / "a-file").write_text("x")
    return tmp / "a-file"


def _import(folder: Path, tmp: Path) -> list[str]:
    return ["import", str(folder), "--out", str(tmp / "imported")]


def _npy_config(t: Path, tr, files: dict[str, bytes], **source) -> list[str]:
    """Train on OLMo token files written to t/npy (name -> raw bytes), with the trained run's model."""
    (t / "npy").mkdir()
    for name, data in files.items():
        (t / "npy" / name).write_bytes(data)
    config = yaml.safe_load(Path(tr[0]).read_text())
    config["data"] = {"sources": [{"glob": str(t / "npy" / "*.npy"), **source}]}
    (t / "npy.yaml").write_text(yaml.safe_dump(config))
    return _train(t / "npy.yaml", t / "r")


def _recipe_config(t: Path, tr, make_arxiv: bool) -> list[str]:
    """The OLMoE-mix recipe with every source's files present under t/mix except (maybe) arXiv's."""
    recipe = yaml.safe_load((Path(__file__).resolve().parents[2] / "configs/data/olmoe-mix-0924.yaml").read_text())
    for name, entry in recipe["sources"].items():
        if name != "arxiv" or make_arxiv:
            folder = t / "mix" / Path(entry["path"]).parent
            folder.mkdir(parents=True)
            np.arange(200, dtype=np.uint16).tofile(folder / "part-0.npy")
    config = yaml.safe_load(Path(tr[0]).read_text())
    config["data"] = {"recipe": "configs/data/olmoe-mix-0924.yaml", "root": str(t / "mix"), "weights": {"wikipedia": 1e9}}
    (t / "mix.yaml").write_text(yaml.safe_dump(config))
    return _train(t / "mix.yaml", t / "r")


def _uncommitted(trained, tmp: Path) -> Path:
    """The run's only checkpoint without its COMMITTED marker (a copy cut short, or the marker deleted)."""
    run = _copy(trained, tmp)
    (run / "checkpoints" / "step-2" / "COMMITTED").unlink()
    return run


def _meta_a_list(trained, tmp: Path) -> Path:
    """meta.json of valid JSON but not an object, with the manifest rewritten to match."""
    from tests.unit.checkpoint.tampering import reseal

    run = _copy(trained, tmp)
    (run / "checkpoints" / "step-2" / "meta.json").write_text("[1, 2]")
    reseal(run / "checkpoints" / "step-2")
    return run


def _config_edited(trained, tmp: Path) -> Path:
    """The run's config.yaml now names a model of fewer layers than its checkpoint holds."""
    run = _copy(trained, tmp)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["model"]["n_layers"] = 1
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def _bin_beyond_vocab(t: Path, tr) -> list[str]:
    """A tokenized folder whose train.bin (sidecar intact) holds ids the model has no embedding row for."""
    source = yaml.safe_load(Path(tr[0]).read_text())["data"]["sources"][0]["path"]
    shutil.copytree(source, t / "tok")
    size = (t / "tok" / "train.bin").stat().st_size
    np.full(size // 2, 60000, np.uint16).tofile(t / "tok" / "train.bin")
    config = yaml.safe_load(Path(tr[0]).read_text())
    config["data"] = {"sources": [{"path": str(t / "tok")}]}
    (t / "bin.yaml").write_text(yaml.safe_dump(config))
    return _train(t / "bin.yaml", t / "r")


BAD_INPUT_CASES = {
    # run directories, checked at start-up before any step
    "run.dir is a file": (lambda t, tr: (t / "f").write_text("x") and _train(tr[0], t / "f"),
                          "is a file, not a directory"),
    "run.dir under /proc": (lambda t, tr: _train(tr[0], Path("/proc/optimus-run")), "cannot write checkpoints"),
    "checkpoints is a file": (lambda t, tr: ((t / "r").mkdir(), (t / "r" / "checkpoints").write_text("x"))
                              and _train(tr[0], t / "r"), "checkpoints' is a file"),
    "latest is a directory": (lambda t, tr: (t / "r" / "latest").mkdir(parents=True) or _train(tr[0], t / "r"),
                              "latest' is not a file"),
    # checkpoints
    "garbled index, eval": (lambda t, tr: ["eval", str(_garbled_index(tr, t)), "--batches", "1"],
                            "step-2 could not be loaded"),
    "garbled index, resume": (lambda t, tr: _train(tr[0], _garbled_index(tr, t)), "step-2 could not be loaded"),
    "COMMITTED garbage": (lambda t, tr: (_copy(tr, t) / "checkpoints/step-2/COMMITTED").write_text("{")
                          and ["generate", str(t / "run"), "--prompt", "Hi"], "COMMITTED cannot be read"),
    "step folder without COMMITTED, resume": (lambda t, tr: _train(tr[0], _uncommitted(tr, t)),
                                              "no COMMITTED marker"),
    "meta.json a list, resume": (lambda t, tr: _train(tr[0], _meta_a_list(tr, t)), "meta.json holds a list"),
    "config.yaml edited, eval": (lambda t, tr: ["eval", str(_config_edited(tr, t)), "--batches", "1"],
                                 "restore the run's config.yaml"),
    "config.yaml edited, export": (lambda t, tr: ["export", str(_config_edited(tr, t)), "--format", "hf", "--out",
                                                  str(t / "hf")], "model.n_layers = 2"),
    "eval sequence of 0": (lambda t, tr: ["eval", str(tr[1]), "--seq-len", "0"], "--seq-len 0: must be at least 1"),
    "verify, not a run": (lambda t, tr: ["verify", str(t)], "holds no checkpoints folder"),
    "verify, a file": (lambda t, tr: ["verify", str(_file(t))], "is a file: pass the run.dir of a training run"),
    "verify, no checkpoint": (lambda t, tr: (t / "checkpoints").mkdir() or ["verify", str(t)], "no checkpoint yet"),
    # Hugging Face folders
    "HF config.json a list": (lambda t, tr: _import(_hf_folder(t, config=[1, 2]), t), "holds a list, not a JSON object"),
    "HF truncated safetensors": (lambda t, tr: _import(_hf_folder(t, weights=b"truncate"), t),
                                 "not a readable safetensors file"),
    "HF random safetensors": (lambda t, tr: _import(_hf_folder(t, weights=bytes(range(256)) * 8), t),
                              "not a readable safetensors file"),
    "HF index not JSON": (lambda t, tr: _import(_hf_folder(t, index="{weight_map"), t), "index.json in"),
    "HF index weight_map a list": (lambda t, tr: _import(_hf_folder(t, index='{"weight_map": ["a"]}'), t),
                                   "malformed (AttributeError)"),
    "HF index shard outside": (lambda t, tr: _import(_hf_folder(t, index='{"weight_map": {"x": "../x"}}'), t),
                               "not a file name"),
    # OLMo/Dolma token files and mixture recipes
    "npy glob matches nothing": (lambda t, tr: _npy_config(t, tr, {}), "no files match"),
    "npy file mis-sized": (lambda t, tr: _npy_config(t, tr, {"a.npy": b"\x01\x00" * 500 + b"\x01"}),
                           "not a whole number of uint16 tokens"),
    "npy id beyond vocab": (lambda t, tr: _npy_config(t, tr, {"a.npy": np.full(500, 60000, np.uint16).tobytes()}),
                            "beyond the vocabulary of 50280"),
    "npy uint32 read as uint16": (lambda t, tr: _npy_config(t, tr, {"a.npy": np.arange(500, dtype=np.uint32).tobytes()}),
                                  "set the source's dtype: uint32"),
    "bin ids beyond vocab": (_bin_beyond_vocab, "outside model.vocab_size 50304"),
    "cache_dir is a file": (lambda t, tr: _train(tr[0], t / "r") + [f"--data.cache_dir={_file(t)}",
                                                                   "--data.sources=[{name: sotu}]"],
                            "data.cache_dir"),
    "recipe source missing": (lambda t, tr: _recipe_config(t, tr, make_arxiv=False), "source arxiv: no files at"),
    # where a command writes: refused before any work (the folder on the way is a file)
    "export under a file": (lambda t, tr: ["export", str(tr[1]), "--format", "hf", "--out", str(_file(t) / "hf")],
                            "--out"),
    "report under a file": (lambda t, tr: ["report", str(tr[1]), "--out", str(_file(t) / "r.html")], "--out"),
    "import under a file": (lambda t, tr: ["import", str(t), "--out", str(_file(t) / "run")], "--out"),
    "tokenize under a file": (lambda t, tr: ["tokenize", "--input", str(tr[0]), "--output", str(_file(t) / "tok")],
                              "--output"),
    "tokenize over earlier output": (lambda t, tr: ["tokenize", "--input", str(tr[0]), "--output",
                                                    yaml.safe_load(Path(tr[0]).read_text())["data"]["sources"][0]["path"]],
                                     "already holds tokenized data (train.bin, heldout.bin)"),
    "chaos into a file": (lambda t, tr: ["chaos", str(tr[0]), "--out", str(_file(t))], "is a file: name a directory"),
    "tune under a file": (lambda t, tr: ["tune", str(tr[0]), "--trials", "1", "--out", str(_file(t) / "tune")],
                          "--out"),
    "plan json under a file": (lambda t, tr: ["plan", str(tr[0]), "--cluster", "h100", "--devices", "8", "--json",
                                              str(_file(t) / "p.json")], "--json"),
    "plan config into a folder": (lambda t, tr: ["plan", str(tr[0]), "--cluster", "h100", "--devices", "8",
                                                 "--write-config", str(t)], "is a directory: name a file"),
    "plan tokens not finite": (lambda t, tr: ["plan", str(tr[0]), "--cluster", "h100", "--devices", "8", "--tokens",
                                              "nan"], "--tokens must be a positive number"),
    "plan cluster file negative": (lambda t, tr: ["plan", str(tr[0]), "--cluster", str(_cluster_file(t, hbm_gb_s=-1)),
                                                  "--devices", "8"], "hbm_gb_s must be a positive number (got -1)"),
    "plan cluster file missing": (lambda t, tr: ["plan", str(tr[0]), "--cluster", str(t / "mine.yaml"), "--devices",
                                                 "8"], "cluster file '"),
    "info sequence of 0": (lambda t, tr: ["info", "mula-1b", "--seq-len", "0"], "--seq-len must be at least 1"),
    "info config file missing": (lambda t, tr: ["info", str(t / "mine.yaml")], "mine.yaml' not found: give the path"),
    "info config is a folder": (lambda t, tr: ["info", str(t)], "' is a directory: give the path of a YAML config"),
    "generate at temperature nan": (lambda t, tr: ["generate", str(tr[1]), "--prompt", "Hi", "--temperature", "nan"],
                                    "--temperature must be a number >= 0"),
    "generate with a seed past 64 bits": (lambda t, tr: ["generate", str(tr[1]), "--prompt", "Hi", "--seed",
                                                         str(2**64 + 1)], "--seed 18446744073709551617: use 0 <= seed"),
    "generate a prompt of undecodable bytes": (lambda t, tr: ["generate", str(tr[1]), "--prompt", "\udcff\x01"],
                                               "--prompt is not valid UTF-8"),
    "train with a seed past 64 bits": (lambda t, tr: _train(tr[0], t / "r") + [f"--train.seed={2**64 + 1}"],
                                       "train.seed"),
    "mixture weights summing to inf": (lambda t, tr: _train(tr[0], t / "r") + [
        "--data.sources=[{name: sotu, weight: 1e308}, {name: stdlib, weight: 1e308}]"], "whose sum is finite"),
    "chaos hang timeout -1": (lambda t, tr: ["chaos", str(tr[0]), "--hang-timeout", "-1", "--out", str(t / "c")],
                              "--hang-timeout must be a positive number of seconds"),
}


def _cluster_file(folder, **changes):
    path = folder / "mine.yaml"
    path.write_text(yaml.safe_dump({"base": "h100", "name": "mine", **changes}))
    return path


@pytest.mark.parametrize("case", list(BAD_INPUT_CASES))
def test_bad_input_table(case, capsys, tmp_path, trained):
    build, expected = BAD_INPUT_CASES[case]
    argv = build(tmp_path, trained)
    capsys.readouterr()
    err = fail_line(capsys, argv)
    assert expected in err, err


@pytest.mark.parametrize("asynchronous", [False, True])
def test_disk_full_while_saving_is_one_line_and_keeps_the_previous_checkpoint(asynchronous, capsys, tmp_path,
                                                                               trained, monkeypatch):
    from torch.distributed.checkpoint import FileSystemWriter

    run = _copy(trained, tmp_path)
    before = snapshot(run / "checkpoints")

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    err = fail_line(capsys, [*_train(trained[0], run), f"--train.async_checkpoint={str(asynchronous).lower()}"])
    assert "step-4 could not be written" in err and "No space left on device" in err
    assert snapshot(run / "checkpoints") == before and (run / "latest").read_text().strip() == "2"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 110 MiB tmpfs: room for one checkpoint of the tiny model (about 77 MB) but not two."""
    import os
    import subprocess

    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=110m", "tmpfs", str(mount)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_really_full_disk_fails_the_save_in_one_line_and_keeps_the_previous_checkpoint(capsys, small_tmpfs, trained):
    cfg, _ = trained
    run = small_tmpfs / "run"
    err = fail_line(capsys, _train(cfg, run))
    assert "step-4 could not be written" in err and "the disk is full" in err
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step-2"]
    assert (run / "latest").read_text().strip() == "2"
    from optimus.checkpoint.manager import CheckpointManager

    assert CheckpointManager(run).find_problem(2) is None


def test_an_uncommitted_step_folder_is_never_deleted(capsys, tmp_path, trained):
    """A step folder without its marker is no checkpoint to resume from, but its files are kept: alone it stops
    the run (above); beside an older good checkpoint the run resumes from that one and keeps it aside."""
    run = _copy(trained, tmp_path)
    good = run / "checkpoints" / "step-2"
    shutil.copytree(good, run / "checkpoints" / "step-4")
    (run / "checkpoints" / "step-4" / "COMMITTED").unlink()
    kept = snapshot(run / "checkpoints" / "step-4")
    assert main(_train(trained[0], run) + ["--train.max_steps=3"]) == 0
    assert "skipped checkpoint step-4 (no COMMITTED marker" in capsys.readouterr().err
    assert snapshot(run / "checkpoints" / "damaged-step-4") == kept


def test_permission_denied_is_one_line(capsys, tmp_path, trained, monkeypatch):
    # as root (CI containers) chmod 000 does not bite: the error is raised where the run directory is first read
    import optimus.checkpoint.manager as manager

    def denied(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(manager, "check_run_dir", denied)
    err = fail_line(capsys, _train(trained[0], tmp_path / "r"))
    assert f"permission denied on {tmp_path / 'r'}" in err


def test_a_rank_past_the_launchers_world_is_one_line(capsys, tmp_path, trained, monkeypatch):
    # rank 3 would stay quiet as a non-zero rank: the line must come all the same
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert "rank 3 of a world of 2" in fail_line(capsys, _train(trained[0], tmp_path / "r"))
    assert not (tmp_path / "r").exists()
