"""The error tree: one home, one name per class, one problem type and one MOQT code each."""

import asyncio
import importlib
import pkgutil

import pytest

import kvsp_moq
from kvsp_moq import errors
from kvsp_moq.errors import RequestErrorCode, SessionCloseCode
from kvsp_moq.moqt.certs import generate_self_signed
from kvsp_moq.moqt.d18 import messages as m
from kvsp_moq.moqt.quic import connect, serve
from kvsp_moq.protocol.problems import Problem

CERT = generate_self_signed()
NS = ("kvsp", "c" * 32, "s" * 16, "p" * 16, "k" * 32)
STEP = 10.0


def _tree(cls: type) -> list[type]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(c for c in _tree(sub) if c not in out)
    return out


def _import_everything() -> None:
    for package in ("kvsp_moq", "relay", "index", "pc", "agent"):
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, package + "."):
            if info.name.endswith("__main__"):
                continue
            try:
                importlib.import_module(info.name)
            except ModuleNotFoundError as e:  # the vLLM connector's modules, in their own venv
                if e.name != "vllm":
                    raise


def test_every_error_class_is_defined_in_the_errors_module():
    _import_everything()
    strays = [f"{c.__module__}.{c.__qualname__}" for c in _tree(errors.KvspError)
              if c.__module__ != "kvsp_moq.errors" and not c.__name__.startswith("_")]
    assert strays == []


def test_every_error_class_is_importable_from_errors_under_one_name():
    classes = [c for c in _tree(errors.KvspError) if not c.__name__.startswith("_")]
    names = [c.__name__ for c in classes]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    for cls in classes:
        assert getattr(errors, cls.__name__) is cls
    assert kvsp_moq.moqt.errors.ProtocolViolation is errors.ProtocolViolation
    assert kvsp_moq.moqt.errors.Unauthorized is errors.Unauthorized


def test_each_class_maps_to_a_problem_type_and_codes_of_the_right_space():
    for cls in _tree(errors.KvspError):
        if cls.__name__.startswith("_"):
            continue
        err = cls.__new__(cls)
        errors.KvspError.__init__(err, "x")
        assert err.problem_type.startswith("urn:kvsp:problem:kvsp-")
        assert 300 <= cls.status <= 599, cls
        assert int(err.request_code) in set(RequestErrorCode), cls
        if not issubclass(cls, errors.SessionError):
            assert int(err.session_code) in set(SessionCloseCode), cls


def test_codes_where_the_spaces_differ():
    # 0x3 is PROTOCOL_VIOLATION among close codes but NOT_SUPPORTED among request codes.
    assert errors.ProtocolViolation.session_code == SessionCloseCode.PROTOCOL_VIOLATION
    assert errors.ProtocolViolation("x").request_code == RequestErrorCode.INTERNAL_ERROR
    assert errors.DigestMismatch("x").request_code == RequestErrorCode.MALFORMED_TRACK
    assert errors.Unauthorized("x").request_code == RequestErrorCode.UNAUTHORIZED
    assert errors.Unauthorized("x").session_code == SessionCloseCode.UNAUTHORIZED
    assert errors.NotFound("x").request_code == RequestErrorCode.DOES_NOT_EXIST
    assert errors.LeaseQuota("x").request_code == RequestErrorCode.EXCESSIVE_LOAD
    assert errors.InvalidRequestId("x").session_code == SessionCloseCode.INVALID_REQUEST_ID


def test_a_malformed_moqt_message_is_the_projects_protocol_violation():
    with pytest.raises(errors.ProtocolViolation):
        m.decode_message(b"\x03\x00\x05\xff\xff\xff\xff\xff")


def test_received_refusals_are_caught_as_the_kvsp_condition():
    missing = errors.request_error_for(RequestErrorCode.DOES_NOT_EXIST, "gone")
    refused = errors.request_error_for(RequestErrorCode.UNAUTHORIZED, "no")
    assert isinstance(missing, errors.NotFound) and isinstance(missing, errors.RequestError)
    assert isinstance(refused, errors.Unauthorized) and refused.error_code == RequestErrorCode.UNAUTHORIZED
    assert isinstance(errors.request_error_for(0x7777, "grease"), errors.RequestError)


def test_problem_documents_round_trip_to_the_same_class():
    for cls in (errors.NotFound, errors.LeaseQuota, errors.StoreFull, errors.NotActive,
                errors.NoActiveInstance, errors.PayloadTooLarge, errors.CodecUnavailable):
        again = Problem.from_json(Problem.from_error(cls("why")).to_json()).to_error()
        assert type(again) is cls and again.detail == "why"


def test_setting_errors_stay_value_errors():
    assert issubclass(errors.SettingError, ValueError) and issubclass(errors.UsageError, errors.SettingError)


@pytest.mark.parametrize("raised, code", [
    (errors.NotFound("no such block"), RequestErrorCode.DOES_NOT_EXIST),
    (errors.ForbiddenScope("not yours"), RequestErrorCode.UNAUTHORIZED),
    (errors.LeaseQuota("too many"), RequestErrorCode.EXCESSIVE_LOAD),
    (errors.NotActive("draining"), RequestErrorCode.GOING_AWAY),
    (errors.DigestMismatch("bad bytes"), RequestErrorCode.MALFORMED_TRACK),
])
async def test_a_handler_failing_with_a_kvsp_error_is_answered_with_its_own_code(raised, code):
    async def on_fetch(request):
        raise raised

    server = await serve(certificate=CERT, handlers={"fetch": on_fetch})
    try:
        client = await asyncio.wait_for(connect(server.url + "/kv", cadata=CERT.certificate_pem), STEP)
        try:
            with pytest.raises(errors.RequestError) as caught:
                await asyncio.wait_for(client.fetch(NS, "1", (0, 0), (0, 3)), STEP)
            assert (caught.value.error_code, caught.value.reason) == (code, raised.detail)
        finally:
            await client.aclose()
    finally:
        await server.aclose()
