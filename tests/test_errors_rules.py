"""errors' rules a mutation audit found unguarded: where `shown` starts cutting and what the
cut keeps, that only the overloaded trailer marks a call as busy, that unreadable trailers
read as none, and the status each domain error is (a gRPC error faked by test_warm_loop's
Err)."""

from __future__ import annotations

import grpc
import pytest

from services.common import errors
from services.common.errors import (
    OVERLOADED_KEY,
    SHOWN_CHARS,
    PinRefused,
    overloaded,
    prefill_work,
    shown,
)
from tests.orchestrator.test_warm_loop import Err

BUSY = grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_value_of_the_shown_length_is_repeated_whole_and_one_more_is_cut():
    """shown() repeats a value of SHOWN_CHARS characters as it is; one character more is cut
    to its first SHOWN_CHARS characters, the full length said."""
    at = "a" * (SHOWN_CHARS - 1) + "z"
    assert shown(at) == repr(at)
    past = at + "!"
    assert shown(past) == f"{at!r}... ({SHOWN_CHARS + 1} characters)"


def test_only_the_overloaded_trailer_marks_a_call_overloaded():
    """A refusal carrying other tiercache trailers (a PinRefused's work figures) is not "busy
    now": another replica would refuse it too."""
    pin = PinRefused("pin refused", 10, 4, 6)
    assert not overloaded(Err(BUSY, "pin refused", pin.trailers))
    assert overloaded(Err(BUSY, "queue full", [(OVERLOADED_KEY, "1")]))


def test_an_error_whose_trailers_cannot_be_read_is_not_overloaded_and_did_no_work():
    """A call object whose trailing_metadata() raises reads as no trailers at all."""

    class Broken(Err):
        def trailing_metadata(self):
            raise RuntimeError("call not finished")

    e = Broken(BUSY, "x")
    assert overloaded(e) is False
    assert prefill_work(e) == (0, 0, 0)


def test_each_domain_error_is_its_own_status():
    """The code each error class maps to (the adapter aborts with it)."""
    want = {errors.InvalidArgument: "INVALID_ARGUMENT", errors.NotFound: "NOT_FOUND",
            errors.ResourceExhausted: "RESOURCE_EXHAUSTED",
            errors.Overloaded: "RESOURCE_EXHAUSTED",
            errors.FailedPrecondition: "FAILED_PRECONDITION",
            errors.Unavailable: "UNAVAILABLE", errors.DeadlineExceeded: "DEADLINE_EXCEEDED",
            errors.Unauthenticated: "UNAUTHENTICATED",
            errors.PermissionDenied: "PERMISSION_DENIED", errors.Cancelled: "CANCELLED",
            errors.TierCacheError: "INTERNAL"}
    assert {cls: cls.code for cls in want} == want
    assert all(hasattr(grpc.StatusCode, code) for code in want.values())


def test_a_non_ascii_status_message_is_capped_by_its_size_on_the_wire():
    """gRPC percent-encodes a status message (3 bytes per UTF-8 byte outside printable
    ASCII) and refuses trailers past 16 KiB: 2,048 emoji (24 KiB) reached the client as
    RESOURCE_EXHAUSTED "Stream removed", naming no field. Cut, it arrives as sent."""
    from concurrent import futures

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from services.common.bootstrap import _capped

    class Refuse(health_pb2_grpc.HealthServicer):
        def Check(self, request, context):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _capped(request.service))

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(Refuse(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for text in ("\U0001f642" * 2048, "\u00e9" * 2048, "\u00e9" * 5000):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Check(health_pb2.HealthCheckRequest(service=text), timeout=10)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
                kept = e.value.details().partition("...")[0]
                assert kept and text.startswith(kept)
                assert e.value.details().endswith(f"({len(text) - len(kept)} characters cut)")
    finally:
        server.stop(0)


@pytest.mark.parametrize("text", [
    "\u0600", "\u06dd", "\u070f", "\u08e2", "\U000110bd",  # format characters drawn as signs
    "\u0301", "👨\u200d👩\u200d👧", "\u200fשלום\u200e", "\u2801", "\u0915\u094d\u200d",
])
def test_text_a_reader_sees_is_not_blank(text):
    """The Arabic number sign, end of ayah (۝), the Syriac abbreviation mark and the Kaithi
    number sign are format characters (Cf) that are drawn, spanning the digits after them:
    a question of only "۝" was refused as empty. A lone combining mark, an emoji joined by
    ZWJ, right-to-left text between direction marks, a Braille cell with a dot are text
    too."""
    assert not errors.blank(text)
    assert errors.blank(" \u200b\u200d\ufeff\u2060\u00ad\x00\u200e\U000e0041\n")


@pytest.mark.parametrize("text", [
    "\u3164", "\u115f", "\u1160", "\uffa0", "\u3164 \u3164\n",  # the Hangul fillers
    "\ufe00", "\ufe0f", "\U000e0100", "\U000e01ef", "\ufe0f\u200d\ufe0f",  # selectors
    "\u034f", "\u180b", "\u17b4",  # CGJ, a Mongolian FVS, a Khmer inherent vowel
    "\u2800", "\u2800 \u2800\n",  # the Braille blank: a cell with no dot, drawn as a space
])
def test_text_of_characters_that_draw_nothing_is_blank(text):
    """Unicode's default-ignorable letters and marks draw nothing, as zero-width spaces: a
    question of only Hangul fillers (Lo) or variation selectors (Mn) was answered and
    stored, and every other such question then hit it. The shared rule agrees."""
    from tests.blank_text import blank as rule

    assert errors.blank(text) and rule(text)
    assert not errors.blank(text + "a") and not errors.blank("\u2764\ufe0f")
    assert not errors.blank("\u1100\u1160")  # a jamo with the vowel filler: a syllable


@pytest.mark.parametrize("bad", ["m\x1b[2J\n", "llama\u200b", "m\u3164", "m\tx", "m\u2028",
                                 "\u202emodel", "m\u00a0x", "m\ufe0f"])
def test_a_model_id_holding_a_character_that_prints_as_nothing_has_a_problem(bad):
    """The rule the prefix index, the semantic tier, kvpool and the configs share for model
    ids: a control, format or invisible character, or whitespace other than a plain space,
    is named by its code point; every id a hub or a model folder gives has none (NFD too)."""
    from tests.blank_text import lookalike

    assert errors.model_id_problem(bad).startswith("holds U+") and lookalike(bad)
    for good in ("HuggingFaceTB/SmolLM2-135M-Instruct", "Qwen2.5-0.5B", "my model",
                 "models--org--name", "llama_3.1:8b", "café", "cafe\u0301", ""):
        assert errors.model_id_problem(good) == ""
