"""Every `lowfp` command the README shows runs as written (usage lines with [options] aside, and the
two setup commands at its top, which CI itself runs). Long runs get options appended that shorten
them (argparse keeps the last value), and `~/data` points at generated CIFAR files."""

import os
import shlex
import subprocess
import sys

import pytest

from test_data import write_cifar

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")
SHORTER = {
    "train": ["--epochs", "1"],
    "sweep": ["--epochs", "1", "--seeds", "0", "--r", "0.5", "--strategies", "fp32,ours",
              "--promotion", "on", "--jobs", "1"],
}


def readme_commands():
    commands, fence = [], None  # fence: the open code block's language, "" for a plain one
    with open(README) as f:
        for line in f:
            if line.startswith("```"):
                fence = line[3:].strip() if fence is None else None
            elif fence in ("", "bash"):
                line = line.split("  #", 1)[0].strip()
                if line.startswith("lowfp ") and "[" not in line:
                    commands.append(line)
    return commands


def test_the_readme_shows_the_commands_this_file_runs():
    commands = readme_commands()
    assert sum(c.startswith("lowfp train") for c in commands) >= 2
    assert sum(c.startswith("lowfp sweep") for c in commands) >= 3
    assert any(c.startswith("lowfp formats") for c in commands)


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_runs(command, tmp_path):
    write_cifar(str(tmp_path / "data"), 10)
    args = shlex.split(command.replace("~", str(tmp_path)))[1:]
    args += SHORTER.get(args[0], [])
    r = subprocess.run([sys.executable, "-m", "lowfp", *args], capture_output=True, text=True,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, (command, r.stderr[-2000:])
    if "--json" in args:
        assert (tmp_path / args[args.index("--json") + 1]).exists()
