"""`--quic-engine` and `--datagram-size` of the MOQT services become their settings' `quic`
field (the process environment is left alone), and a bad value is one line."""

from __future__ import annotations

import os
from typing import Any

import pytest

from kvsp_moq import cli
from kvsp_moq.errors import SettingError
from kvsp_moq.moqt.quic.settings import DATAGRAM_SIZE_ENV, ENGINE_ENV


def settings_of(argv: list[str]) -> Any:
    args = cli.build_parser(argv).parse_args(argv)
    cli._apply_engine_option(args)
    module = __import__(cli.SERVICES[argv[0]][0], fromlist=["settings_from_args"])
    made = module.settings_from_args(args)
    return made[0] if isinstance(made, tuple) else made  # the relay's comes with its notes


@pytest.mark.parametrize("service", ["holder", "agent", "relay"])
def test_the_options_are_the_services_quic_settings(service: str, monkeypatch, tmp_path) -> None:
    monkeypatch.delenv(ENGINE_ENV, raising=False)
    monkeypatch.delenv(DATAGRAM_SIZE_ENV, raising=False)
    extra = ["--cert-dir", str(tmp_path)] if service == "relay" else []
    settings = settings_of([service, "--quic-engine", "aioquic", "--datagram-size", "9000", *extra])
    assert (settings.quic.engine, settings.quic.max_datagram_size) == ("aioquic", 9000)
    assert ENGINE_ENV not in os.environ and DATAGRAM_SIZE_ENV not in os.environ
    default = settings_of([service, *extra])
    assert default.quic.max_datagram_size is None  # chosen by destination


@pytest.mark.parametrize(("option", "value"), [("--quic-engine", "quiche"),
                                               ("--datagram-size", "900"),
                                               ("--datagram-size", "jumbo")])
def test_a_bad_value_is_one_line(option: str, value: str) -> None:
    with pytest.raises(SettingError) as caught:
        settings_of(["holder", option, value])
    assert "\n" not in str(caught.value) and value in str(caught.value)
