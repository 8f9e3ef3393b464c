"""Every command the README shows exists and explains itself, so the README cannot go stale."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def shell_lines() -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", README, re.S)
    return [line.split("#")[0].strip() for b in blocks for line in b.splitlines() if line.strip()]


def kvsp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvsp_moq.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_readme_starts_with_the_two_commands():
    first = shell_lines()[:2]
    assert first == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^demo:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "kvsp demo" in makefile and "pytest" in makefile
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make demo" in ci and "make test" in ci


def test_every_kvsp_command_in_the_readme_exists_with_its_options():
    lines = [text for text in shell_lines() if text.startswith("kvsp ")]
    assert len(lines) >= 8
    for line in lines:
        words = line.split()
        sub = words[1]
        if sub == "bench":
            out = kvsp("bench", "--help")
            assert out.returncode == 0
            for target in words[2].split("|"):
                assert target in out.stdout, (line, target)
            continue
        if sub == "keys":  # a command group: the options are its subcommand's
            for name in words[2].split("|"):
                assert kvsp(sub, name, "--help").returncode == 0, (line, name)
            sub = words[2] if "|" not in words[2] else None
            out = kvsp("keys", sub, "--help") if sub else kvsp("keys", "--help")
        else:
            out = kvsp(sub, "--help")
        assert out.returncode == 0, (line, out.stderr)
        for option in (w for w in words[2:] if w.startswith("--")):
            assert option in out.stdout, (line, option)


def test_demo_options_in_the_readme_exist():
    out = kvsp("demo", "--help")
    assert out.returncode == 0 and "--serve" in out.stdout and "--json" in out.stdout
