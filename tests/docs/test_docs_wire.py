"""The docs spell the wire as ``vllm_nixl_lease/_wire.py`` builds it.

(a) Every message form a doc writes in inline code (``HB:,LHBT:<seq>,<tags>``,
``LACK:<instance>:<seqs>``, ``PUSH_REG:...``, a bare ``LHB:``) is one
``_wire.py`` builds, and every ``remote_lease_*`` key a doc names is one of its
``PARAM_LEASE_*`` values.  (b) ``docs/PROTOCOL.md``, the specification, spells
every message constant, every ``PARAM_LEASE_*`` key and the protocol version.

The known forms come from ``_wire.py`` itself: its bytes constants (the
prefixes, the kinds behind the escape, ``ACK_NONE``) and the messages its
builders return, so a change to the wire fails here until the docs follow.

Forms are compared by shape: a placeholder (``<seq>``) or a value stands for
one field; a list (a field repeated, or followed by ``,...``) is one field, so
``<id>,<id>,...`` is ``<ids>`` while ``<seq>,<ids>`` stays two; ``:``, ``,``
and the literals are kept; ``[...|...]`` spells alternatives and a trailing
``...`` leaves the rest unsaid.  Only inline code is read: prose uses
``D:``/``P:`` as labels.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from docs_text import DOCS, FENCE, INLINE_CODE, ROOT, rel

from vllm_nixl_lease import _wire

PROTOCOL = ROOT / "docs" / "PROTOCOL.md"

MESSAGE_CONSTANTS = {
    name: value.decode("ascii")
    for name, value in vars(_wire).items()
    if name.isupper() and isinstance(value, bytes)
}
# Prefixes and kinds: a message starts with one, or with the escape and a kind.
HEADS = sorted((v for v in MESSAGE_CONSTANTS.values() if any(c.isalpha() for c in v)), key=len, reverse=True)
# Field values spelled literally (ACK_NONE); the separators are ``:`` and the heartbeat's own.
LIST_SEPARATOR = _wire.HEARTBEAT_SEPARATOR.decode("ascii")
FIELD_LITERALS = {v for v in MESSAGE_CONSTANTS.values() if v not in HEADS and v != LIST_SEPARATOR}
LEASE_KEYS = {value for name, value in vars(_wire).items() if name.startswith("PARAM_LEASE_")}

VALUE = "<>"
REST = "..."
# What reads as a message: a head of upper-case letters and a colon, or a placeholder and a
# colon (a completion), then no spaces outside placeholders.
MESSAGE_LIKE = re.compile(r"(?:[A-Z][A-Z_]*:|<[^<>]+>:)(?:<[^<>]*>|[^\s<>])*")
UNKNOWN_HEAD = re.compile(r"[A-Z][A-Z_]*:")
LEASE_KEY = re.compile(r"\bremote_lease_\w+")
LEASE_KEY_NAME = re.compile(r"\bPARAM_LEASE_\w+")
OPTIONAL = re.compile(r"\[([^\[\]]*)\]")

Shape = tuple[str, ...]


def _alternatives(form: str) -> Iterator[str]:
    """``a[:b|:c]`` -> ``a``, ``a:b``, ``a:c``."""
    found = OPTIONAL.search(form)
    if found is None:
        yield form
        return
    for choice in ["", *found.group(1).split("|")]:
        yield from _alternatives(form[: found.start()] + choice + form[found.end() :])


def shape(form: str) -> Shape | str:
    """The shape of one message form; a string saying why when its head is unknown."""
    tokens: list[str] = []
    i = 0
    while True:  # the heads: a prefix, or the escape and a kind
        head = next((h for h in HEADS if form.startswith(h, i)), None)
        if head is None:
            break
        tokens.append(head)
        i += len(head)
    unknown = None if tokens else UNKNOWN_HEAD.match(form)
    if unknown is not None:
        return f"no message of _wire.py starts with {unknown.group()!r}"
    fields: list[str] = []  # the body as written, split at separators
    for part in re.split(r"(<[^<>]*>|:|,|\.\.\.|\u2026)", form[i:]):
        if not part:
            continue
        if fields and _is_value(part) and _is_value(fields[-1]):
            fields[-1] += part  # ``<id>x``: still one field (no separator between)
        else:
            fields.append(REST if part == "\u2026" else part)
    return tuple(tokens) + tuple(VALUE if _is_value(f) else f for f in _collapse_lists(fields))


def _is_value(field: str) -> bool:
    return field not in (":", LIST_SEPARATOR, REST) and field not in FIELD_LITERALS


def _collapse_lists(fields: list[str]) -> list[str]:
    """A list is one field: ``<id>,<id>,...`` and ``<id>,...`` are ``<id>``.  Only the
    same field repeated, or followed by ``,...``, is a list, so ``<seq>,<ids>`` stays two."""
    out: list[str] = []
    for field in fields:
        repeats = len(out) >= 2 and out[-1] == LIST_SEPARATOR and _is_value(out[-2])
        if repeats and field in (out[-2], REST):
            out.pop()
        else:
            out.append(field)
    return out


def known_shapes() -> set[Shape]:
    """Every message _wire.py builds (each list of one name), and each head alone (a
    message named by its head)."""
    instance = _wire.new_instance()
    one_id = _wire.heartbeat_message(["id-1"])
    built = [
        one_id,
        _wire.completion_message("req-1", 2),
        _wire.hello_message(0.5, b"agent metadata", "key-1"),
        _wire.acked_heartbeat_message(7, one_id),
        _wire.acked_heartbeat_message(7, one_id, tagged=True),
        _wire.heartbeat_ack_message(instance, [7]),
        _wire.heartbeat_ack_message(instance, [7], b"key-1"),
        _wire.heartbeat_ack_message(instance, [7], _wire.ACK_NONE),
        _wire.heartbeat_ack_message(instance, []),  # the welcome
    ]
    shapes: set[Shape] = {(head,) for head in HEADS}
    for message in built:
        built_shape = shape(message.decode("ascii"))
        assert not isinstance(built_shape, str), built_shape
        shapes.add(built_shape)
    return shapes


KNOWN = known_shapes()


def _is_known(form_shape: Shape) -> bool:
    if form_shape in KNOWN:
        return True
    if form_shape and form_shape[-1] == REST:  # the rest unsaid: what is said must start a known form
        said = form_shape[:-1]
        return any(known[: len(said)] == said for known in KNOWN)
    return False


def message_forms(text: str) -> list[str]:
    """The message forms a markdown text writes in inline code."""
    return [code for code in INLINE_CODE.findall(FENCE.sub("", text)) if MESSAGE_LIKE.fullmatch(code)]


def wire_errors(text: str) -> list[str]:
    """What a doc's text says about the wire that ``_wire.py`` does not build."""
    errors = []
    for form in message_forms(text):
        for variant in _alternatives(form):
            variant_shape = shape(variant)
            if isinstance(variant_shape, str):
                errors.append(f"`{form}`: {variant_shape}")
            elif not _is_known(variant_shape):
                errors.append(f"`{form}`: _wire.py builds no message of this form ({variant!r})")
    for key in sorted(set(LEASE_KEY.findall(text)) - LEASE_KEYS):
        errors.append(f"`{key}`: not a PARAM_LEASE_* key of _wire.py")
    for name in sorted(set(LEASE_KEY_NAME.findall(text)) - set(vars(_wire))):
        errors.append(f"`{name}`: _wire.py has no such key")
    return errors


def protocol_omissions(text: str) -> list[str]:
    """What of ``_wire.py`` the specification does not spell."""
    forms = message_forms(text)
    heads_spelled = {token for form in forms for v in _alternatives(form) for token in _tokens(v)}
    missing = []
    for name, value in sorted(MESSAGE_CONSTANTS.items()):
        if value in HEADS or value in FIELD_LITERALS:
            spelled = value in heads_spelled
        else:
            spelled = any(value in form for form in forms)
        if not spelled:
            missing.append(f"{name} ({value!r})")
    code = set(INLINE_CODE.findall(text))
    missing += [f"{key} (a kv_transfer_params key)" for key in sorted(LEASE_KEYS - code)]
    version = re.search(r"Protocol version: \*\*(\d+)\*\*", text)
    if version is None or int(version.group(1)) != _wire.LEASE_PROTOCOL_VERSION:
        missing.append(f"'Protocol version: **{_wire.LEASE_PROTOCOL_VERSION}**'")
    return missing


def _tokens(form: str) -> Iterable[str]:
    result = shape(form)
    return () if isinstance(result, str) else result


@pytest.mark.parametrize("md", DOCS, ids=rel)
def test_docs_spell_the_wire_as_wire_py_builds_it(md: Path) -> None:
    errors = wire_errors(md.read_text())
    assert not errors, f"{rel(md)}:\n" + "\n".join(errors)


def test_protocol_md_spells_everything_wire_py_sends() -> None:
    missing = protocol_omissions(PROTOCOL.read_text())
    assert not missing, f"docs/PROTOCOL.md does not spell: {missing}"


def test_every_form_protocol_md_specifies_is_read() -> None:
    """The checker reads the specification's table: each message row is a form."""
    forms = set(message_forms(PROTOCOL.read_text()))
    assert {"HB:,LHELLO:<ver>:<interval_ms>:<metadata>:<key>", "LACK:<instance>:", "<id>:<count>"} <= forms


# -- the checker itself fails on what it must catch ----------------------------------------


@pytest.mark.parametrize(
    "form",
    [
        "LHB:<seq>:<ids>",  # version 1: raw, and a colon after the sequence number
        "LHBT:<seq>:<tag>,<tag>,...",
        "LHBT:<seq>,<tags>",  # a kind with a body, but without the escape
        "LACK:<seq>,<seq>,...",  # version 1's answer: no instance
        "LHELLO:<its NIXL connection info>",
        "HB:,LHELLO:<ver>:<interval_ms>:<metadata>",  # a field short
        "HB:,LHB:<seq>:<ids>",
        "LACK:<instance>:<seqs>:<keys>:<more>",
        "LACK:<instance>:<seqs>[:<keys>|:<keys>:*]",  # one alternative is wrong
        "LHB:<seq>:",
        "HB:,LHB:<ids>",  # no sequence number
        "LACK:<instance>",  # the welcome without its colon
        "X:<count>",  # a head _wire.py does not have
        "LNACK:<seq>",
    ],
)
def test_checker_reports_a_form_wire_py_does_not_build(form: str) -> None:
    text = f"D sends `{form}` to P."
    assert message_forms(text) == [form]
    assert wire_errors(text), form


@pytest.mark.parametrize(
    "form",
    [
        "HB:<id>,<id>,...",
        "HB:<id>,...",
        "HB:",
        "HB:,",
        "<req_id>:<count>",
        "PUSH_REG:...",
        "PUSH_REG:",
        "LHELLO:",
        "LHELLO:...",
        "HB:,LHELLO:<ver>:<interval_ms>:<metadata>:<key>",
        "HB:,LHB:<seq>,<ids>",
        "HB:,LHBT:<seq>,<tag>,<tag>,...",
        "LACK:<instance>:<seqs>[:<keys not held>|:*]",
        "LACK:<instance>:<seqs>:<key>,<key>,...",
        "LACK:<instance>:",
        "LACK:",
    ],
)
def test_checker_accepts_what_wire_py_builds(form: str) -> None:
    assert wire_errors(f"D sends `{form}` to P.") == [], form


def test_checker_reports_keys_wire_py_does_not_have() -> None:
    text = "P adds `remote_lease_acks` and remote_lease_tags; `PARAM_LEASE_ACKS` names one."
    errors = wire_errors(text)
    assert len(errors) == 3 and all(any(k in e for e in errors) for k in ("acks`", "tags", "ACKS")), errors
    assert wire_errors("P adds `remote_lease_deadline`, `PARAM_LEASE_TAG`.") == []


def test_checker_reports_what_the_specification_leaves_out() -> None:
    spec = PROTOCOL.read_text()
    assert protocol_omissions(spec.replace("LHBT:", "LHB:")) == ["TAGGED_HEARTBEAT_KIND ('LHBT:')"]
    assert protocol_omissions(spec.replace("`LACK:<instance>:<seqs>:*`", "`LACK:<instance>:<seqs>`")) == [
        "ACK_NONE ('*')"
    ]
    without_tag_key = spec.replace("`remote_lease_tag`", "the tag key")
    assert protocol_omissions(without_tag_key) == ["remote_lease_tag (a kv_transfer_params key)"]
    other_version = spec.replace(
        f"Protocol version: **{_wire.LEASE_PROTOCOL_VERSION}**",
        f"Protocol version: **{_wire.LEASE_PROTOCOL_VERSION + 1}**",
    )
    assert protocol_omissions(other_version) == [f"'Protocol version: **{_wire.LEASE_PROTOCOL_VERSION}**'"]
