"""Protocol version 3 on the wire (``_wire.py``): P's clock in its answers,
``LACK:<instance>@<clock_us>:<seqs>[:<keys>]``, and the hello version D reads
from P's params (docs/PROTOCOL.md sections 2 and 4.3)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from vllm_nixl_lease._wire import (
    ACK_NONE,
    CLAIM_HELLO_VERSION,
    LEASE_PROTOCOL_BASE,
    MAX_CLOCK_S,
    PARAM_LEASE_DEADLINE,
    PARAM_LEASE_EXTENSION,
    PARAM_LEASE_INSTANCE,
    PARAM_LEASE_INTERVAL,
    PARAM_LEASE_PROTOCOL,
    PARAM_LEASE_PROTOCOL_MAX,
    LeaseTerms,
    heartbeat_ack_message,
    lease_terms,
    parse_heartbeat_ack,
)

I16 = "0123456789abcdef"


def test_clock_round_trips_in_every_answer_form() -> None:
    for not_extended, expected in ((b"", frozenset()), (b"x,y:z", frozenset({"x", "y:z"})), (ACK_NONE, None)):
        msg = heartbeat_ack_message(I16, [7, 9], not_extended, clock=1234.5)
        assert msg.startswith(b"LACK:" + I16.encode() + b"@1234500000:7,9")
        assert parse_heartbeat_ack(msg) == (I16, [7, 9], expected, 1234.5)


@given(st.floats(0, 1e9, allow_nan=False))
@example(281474977.12373203)  # ceil(clock * 1e6) / 1e6 lands a float step under it
def test_the_clock_is_rounded_up(clock: float) -> None:
    """Never earlier than P's reading: a later one only makes D's offset larger (safer)."""
    ack = parse_heartbeat_ack(heartbeat_ack_message(I16, [1], clock=clock))
    assert ack is not None and ack.clock is not None
    assert clock <= ack.clock <= clock + 2e-6


def test_no_clock_is_version_2s_form() -> None:
    assert heartbeat_ack_message(I16, [7]) == b"LACK:" + I16.encode() + b":7"
    assert parse_heartbeat_ack(b"LACK:" + I16.encode() + b":7") == (I16, [7], frozenset(), None)
    # What P cannot state truthfully it leaves out.
    for bad in (-1.0, math.inf, -math.inf, math.nan, MAX_CLOCK_S):
        assert heartbeat_ack_message(I16, [7], clock=bad) == heartbeat_ack_message(I16, [7])


@pytest.mark.parametrize(
    "field",
    [
        b"@",  # no digits
        b"@x",
        b"@-1",
        b"@1.5",
        b"@1@2",
        b"@ 1",
        b"@" + b"1" * 21,  # past 20 digits
        b"@\xff",
    ],
)
def test_hostile_clocks_are_malformed(field: bytes) -> None:
    assert parse_heartbeat_ack(b"LACK:" + I16.encode() + field + b":7") is None


def test_the_instance_stays_strict_with_a_clock() -> None:
    for instance in (I16.upper(), I16[:-1], I16 + "0", "@" + I16):
        assert parse_heartbeat_ack(b"LACK:" + instance.encode() + b"@5:7") is None
    assert parse_heartbeat_ack(b"LACK:@5:7") is None


def test_a_welcome_may_carry_a_clock_but_needs_none() -> None:
    assert parse_heartbeat_ack(heartbeat_ack_message(I16, [], clock=3.0)) == (I16, [], frozenset(), 3.0)
    assert parse_heartbeat_ack(heartbeat_ack_message(I16, [])) == (I16, [], frozenset(), None)


def _params(**extra: object) -> dict[str, object]:
    params: dict[str, object] = {
        PARAM_LEASE_DEADLINE: 100.0,
        PARAM_LEASE_EXTENSION: 8.0,
        PARAM_LEASE_PROTOCOL: LEASE_PROTOCOL_BASE,
        PARAM_LEASE_INSTANCE: I16,
    }
    params.update(extra)
    return params


@pytest.mark.parametrize(
    "newest,hello",
    [
        (None, 2),  # a version-2 P: no such key
        (2, 2),
        (3, 3),
        # 4: read claims (kv_lease_claim_reads); D says it only with the setting on (ack_requester.py)
        (4, CLAIM_HELLO_VERSION),
        (10**6, CLAIM_HELLO_VERSION),  # a newer P that still takes 2: the newest both speak
        (1, 2),
        ("3", 2),  # not an integer: the base
        (True, 2),
        (3.0, 2),
    ],
)
def test_hello_version_is_the_newest_both_speak(newest: object, hello: int) -> None:
    extra = {} if newest is None else {PARAM_LEASE_PROTOCOL_MAX: newest}
    terms = lease_terms(_params(**extra))
    assert terms is not None and terms.acknowledged and terms.hello_version == hello


def test_a_p_that_advertises_3_as_its_base_is_plain() -> None:
    """``remote_lease_protocol`` stays 2: a P that says 3 there is an unknown one."""
    terms = lease_terms(_params(**{PARAM_LEASE_PROTOCOL: 3, PARAM_LEASE_PROTOCOL_MAX: 3}))
    assert terms is not None and not terms.acknowledged and terms.hello_version == LEASE_PROTOCOL_BASE


@pytest.mark.parametrize(
    "extra,expected",
    [
        ({}, LeaseTerms(100.0, 8.0, None, I16, None, LEASE_PROTOCOL_BASE)),
        ({PARAM_LEASE_INTERVAL: 5}, LeaseTerms(100.0, 8.0, 5.0, I16)),
        ({PARAM_LEASE_INTERVAL: math.nan}, LeaseTerms(100.0, 8.0, None, I16)),
        ({PARAM_LEASE_INTERVAL: -1.0}, LeaseTerms(100.0, 8.0, None, I16)),
        ({PARAM_LEASE_DEADLINE: 100, PARAM_LEASE_EXTENSION: 8}, LeaseTerms(100.0, 8.0, None, I16)),
        ({PARAM_LEASE_INSTANCE: None, PARAM_LEASE_INTERVAL: 2.5}, LeaseTerms(100.0, 8.0, 2.5)),
    ],
)
def test_lease_terms_are_lease_terms_with_every_field(extra: dict[str, object], expected: LeaseTerms) -> None:
    """Built without the NamedTuple's constructor: the same type, fields and defaults."""
    terms = lease_terms(_params(**extra))
    assert type(terms) is LeaseTerms and terms == expected
    assert terms is not None and type(terms.deadline) is float and type(terms.extension) is float


@pytest.mark.parametrize(
    "deadline,extension",
    [
        (math.nan, 8.0),
        (math.inf, 8.0),
        (100.0, -math.inf),
        (100.0, 0.0),
        (True, 8.0),
        ("1", 8.0),
        (None, 8.0),
    ],
)
def test_malformed_lease_fields_raise(deadline: object, extension: object) -> None:
    with pytest.raises(ValueError):
        lease_terms(_params(**{PARAM_LEASE_DEADLINE: deadline, PARAM_LEASE_EXTENSION: extension}))
