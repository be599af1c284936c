"""`optimus bench`: the checkout's benchmark scripts listed from their docstrings, one run by name with its own
arguments, in the checkout's root and the environment its usage line names; a name or checkout not there is one
line and exit 2."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from optimus.cli import main
from optimus.cli.bench import CHECKOUT, find_benchmarks, run_bench
from optimus.cli.errors import BENCH_PROG_VARIABLE, OneLineErrorParser

REPO = Path(__file__).resolve().parents[3]

# a stand-in benchmark: reports where and how it ran, then exits with the code it is given
REPORTER = '''"""Reports its arguments, folder and environment.

    OMP_NUM_THREADS=1 FAKE_FLAG=on python benchmarks/{name}.py [--code N]
"""
import json, os, sys
print(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "path": os.environ.get("PYTHONPATH", ""),
                  "threads": os.environ.get("OMP_NUM_THREADS"), "flag": os.environ.get("FAKE_FLAG")}}))
sys.exit(int(sys.argv[sys.argv.index("--code") + 1]) if "--code" in sys.argv else 0)
'''


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    folder = tmp_path / "benchmarks"
    folder.mkdir()
    (folder / "reporter.py").write_text(REPORTER.format(name="reporter"))
    (folder / "_common.py").write_text('"""Shared helpers, not a benchmark."""\n')
    (folder / "kernels.sh").write_text("#!/usr/bin/env bash\n# Kernel checks on a GPU:\n#\n#     bash x\n"
                                       "echo shell $1\n")
    return folder


def test_the_listing_is_every_script_with_its_first_sentence(checkout: Path):
    found = find_benchmarks(checkout)
    assert list(found) == ["reporter", "kernels"]  # the _-prefixed helper is not a benchmark
    assert found["reporter"].summary == "Reports its arguments, folder and environment"
    assert found["kernels"].summary == "Kernel checks on a GPU"
    assert found["reporter"].environment == {"OMP_NUM_THREADS": "1", "FAKE_FLAG": "on"}


def test_a_script_runs_in_the_checkout_with_its_arguments_and_environment(checkout: Path, monkeypatch, capfd):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("FAKE_FLAG", "mine")  # what the caller set wins over the usage line
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    assert run_bench(["reporter", "--json", "out.json", "--help"], folder=checkout) == 0
    ran = json.loads(capfd.readouterr().out)
    assert ran["argv"] == ["--json", "out.json", "--help"]  # the script's own flags pass through, --help included
    assert Path(ran["cwd"]) == checkout.parent
    assert ran["path"].split(":") == [str(checkout.parent), "/elsewhere"]
    assert (ran["threads"], ran["flag"]) == ("1", "mine")


def test_the_scripts_exit_code_is_the_commands(checkout: Path, capfd):
    assert run_bench(["reporter.py", "--code", "3"], folder=checkout) == 3
    assert run_bench(["kernels", "go"], folder=checkout) == 0
    assert capfd.readouterr().out.splitlines()[-1] == "shell go"


def test_a_script_a_signal_ended_exits_as_a_shell_reports_it(checkout: Path):
    """A benchmark killed by SIGKILL (the OOM killer) exits 137 = 128 + 9, as the shell would report it, not with
    subprocess's -9 (which the process exit would turn into 247)."""
    (checkout / "crash.sh").write_text("#!/usr/bin/env bash\n# Killed by a signal.\n#\n#     bash x\nkill -KILL $$\n")
    assert run_bench(["crash"], folder=checkout) == 137


def test_an_unknown_name_is_one_line_with_the_nearest(checkout: Path, capsys):
    assert run_bench(["reportr"], folder=checkout) == 2
    assert capsys.readouterr().err == ("optimus bench: error: no benchmark named 'reportr': did you mean reporter? "
                                       "choose one of reporter, kernels (`optimus bench` lists them)\n")


def test_no_checkout_beside_the_package_is_one_line(tmp_path: Path, capsys):
    assert run_bench(["train_step"], folder=tmp_path / "benchmarks") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "clone the repository and install it with `pip install -e .`" in err


def test_the_verb_lists_this_checkouts_benchmarks(capsys):
    assert CHECKOUT == REPO
    assert main(["bench"]) == 0
    out = capsys.readouterr().out
    assert "train_step" in out and "Training-step throughput: Optimus vs Hugging Face OlmoeForCausalLM" in out
    assert "_common" not in out
    # every real script says what it compares, and those that want one thread per rank say so in their usage line
    found = find_benchmarks(REPO / "benchmarks")
    assert all(b.summary for b in found.values())
    assert found["plan_vs_measured"].environment == {"OMP_NUM_THREADS": "1"}


def test_the_verb_runs_a_real_benchmark_by_name(tmp_path: Path, capfd):
    """plan_published without its search: arithmetic on the presets, a few seconds."""
    out = tmp_path / "published.json"
    assert main(["bench", "plan_published", "--no-search", "--json", str(out)]) == 0
    assert "within their bands" in capfd.readouterr().out
    assert json.loads(out.read_text())


def test_a_benchmarks_bad_flag_is_one_line(capfd):
    """A script's refused command line ends as the `optimus` verbs' do: one line naming the flag, exit code 2, no
    usage block before it."""
    assert main(["bench", "plan_published", "--no-such-flag"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == ("optimus bench plan_published: error: unrecognized arguments: --no-such-flag "
                   "(usage: optimus bench plan_published --help)"), err


@pytest.mark.parametrize("where, line", [
    (lambda t: t, "is a directory: name a file"),
    (lambda t: (t / "a-file").write_text("x") and t / "a-file" / "rows.json", "is a file, not a directory"),
])
def test_a_benchmarks_json_output_that_cannot_be_written_is_one_line_before_it_runs(where, line, tmp_path, capfd):
    """Refused as its flags are read, not in a traceback after the timing: the figures would be lost."""
    json_path = where(tmp_path)
    assert main(["bench", "plan_published", "--no-search", "--json", str(json_path)]) == 2
    captured = capfd.readouterr()
    err = captured.err.strip()
    assert err.startswith(f"optimus bench plan_published: error: --json {json_path}") and line in err, err
    assert "\n" not in err and "within their bands" not in captured.out


def test_a_parser_of_the_verbs_leaves_json_to_the_verb(tmp_path):
    """Only the benchmarks' parsers (built without a prog) check --json; `optimus plan` checks its own."""
    parser = OneLineErrorParser(prog="optimus")
    parser.add_argument("--json")
    assert parser.parse_args(["--json", str(tmp_path)]).json == str(tmp_path)


def test_a_benchmark_run_as_a_script_names_itself(monkeypatch, capsys):
    """Run directly, a script names its file; the variable `optimus bench` sets names the verb only for the script
    it ran, not for a program that script starts."""
    monkeypatch.setattr(sys, "argv", ["benchmarks/plan_published.py"])
    monkeypatch.delenv(BENCH_PROG_VARIABLE, raising=False)
    assert OneLineErrorParser().prog == "plan_published.py"
    monkeypatch.setenv(BENCH_PROG_VARIABLE, "moe_layer.py:optimus bench moe_layer")
    assert OneLineErrorParser().prog == "plan_published.py"
    monkeypatch.setenv(BENCH_PROG_VARIABLE, "plan_published.py:optimus bench plan_published")
    assert OneLineErrorParser().prog == "optimus bench plan_published"
    assert OneLineErrorParser(prog="optimus").prog == "optimus"


def test_every_benchmark_parses_its_flags_with_the_one_line_parser():
    """The others are held by reading them (running each would import torch fifteen times): none builds a plain
    argparse parser."""
    scripts = [b.path for b in find_benchmarks(REPO / "benchmarks").values() if b.path.suffix == ".py"]
    plain = [path.name for path in scripts if "argparse.ArgumentParser(" in path.read_text()]
    assert scripts and not plain, plain


def test_a_long_first_sentence_is_cut_at_a_word_within_the_limit():
    """The listing's summary is at most `longest` characters with its "..." counted: 31 words of 4 letters fill
    154 of the 157 kept, the 32nd would end past them."""
    from optimus.cli.bench import _first_sentence

    summary = _first_sentence(" ".join(["abcd"] * 50))
    assert summary == " ".join(["abcd"] * 31) + "..." and len(summary) == 157


def test_a_shell_script_is_named_by_its_file_too(checkout: Path, capfd):
    """`optimus bench kernels.sh` is the script of that file, as `reporter.py` is."""
    assert run_bench(["kernels.sh", "go"], folder=checkout) == 0
    assert capfd.readouterr().out.splitlines()[-1] == "shell go"


def test_the_script_is_told_the_verb_by_its_benchmarks_name_however_it_was_typed(checkout: Path, capfd):
    """Typed with its file's suffix, the script's refusals still name `optimus bench NAME`, which the listing
    shows and which runs it again."""
    (checkout / "prog.py").write_text('"""Says the name its refusals give."""\nimport os\n'
                                      f'print(os.environ["{BENCH_PROG_VARIABLE}"])\n')
    assert run_bench(["prog.py"], folder=checkout) == 0
    assert capfd.readouterr().out.strip() == "prog.py:optimus bench prog"


def test_dash_h_lists_the_benchmarks_as_help_does(checkout: Path, capsys):
    assert run_bench(["-h"], folder=checkout) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: optimus bench ") and "  reporter  Reports its arguments" in out


def test_the_listing_aligns_the_summaries_after_the_longest_name(checkout: Path, capsys):
    assert run_bench([], folder=checkout) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == ["  reporter  Reports its arguments, folder and environment",
                         "  kernels   Kernel checks on a GPU"]


def test_an_interrupted_benchmark_is_one_line_and_exit_130(checkout: Path, monkeypatch, capsys):
    """Ctrl-C while a script runs ends the verb as a shell reports SIGINT (128 + 2), with one line, no traceback."""
    from optimus.cli import bench

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.subprocess, "run", interrupted)
    assert run_bench(["reporter"], folder=checkout) == 130
    assert capsys.readouterr().err == "optimus bench reporter: interrupted\n"
