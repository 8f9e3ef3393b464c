"""Every command that presents a bearer token takes it directly or from a file."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvsp_moq.auth import add_token_options, token_from_args
from kvsp_moq.cli import main
from kvsp_moq.errors import SettingError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_token_options(p, what="token")
    add_token_options(p, "upstream-token", what="upstream token")
    return p


def test_a_token_file_gives_its_text(tmp_path: Path) -> None:
    f = tmp_path / "t"
    f.write_text("s3cret\n")
    args = parser().parse_args(["--token-file", str(f), "--upstream-token", "up"])
    assert token_from_args(args) == "s3cret"
    assert token_from_args(args, "upstream-token") == "up"
    assert token_from_args(parser().parse_args([])) is None


def test_an_empty_or_missing_token_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(SettingError, match="is empty"):
        token_from_args(parser().parse_args(["--token-file", str(tmp_path / "empty")]))
    with pytest.raises(SettingError, match="cannot read --token-file"):
        token_from_args(parser().parse_args(["--token-file", str(tmp_path / "none")]))
    with pytest.raises(SystemExit):  # both: argparse refuses
        parser().parse_args(["--token", "a", "--token-file", "b"])


@pytest.mark.parametrize("command", [["lookup", "--index", "http://127.0.0.1:9/", "--descriptor", "d",
                                      "--scope-keys", "k", "--tokens", "t"],
                                     ["get", "http://127.0.0.1:9/", "--record", "r"]])
def test_tools_refuse_a_missing_token_file_in_one_line(command: list[str], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*command, "--token-file", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--token-file" in err, err


@pytest.mark.parametrize("service", ["holder", "agent", "index"])
def test_servers_take_token_files(service: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([service, "--help"])
    assert "--token-file FILE" in capsys.readouterr().out
