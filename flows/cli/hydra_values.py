"""Hydra override values as Hydra reads them: `{a: 1, b:x}`, `[a, b]`, quoted text, numbers, booleans, null.

A small recursive reader for the value grammar of Hydra's override parser (what `+key=value` gives
NeMo Gym), so `{temperature:0.5}` is a mapping as in NeMo Gym, not a YAML key `temperature:0.5`.
"""

from __future__ import annotations

import re
from typing import Any

NUMBER = re.compile(r"^[+-]?(\d[\d_]*)?(\.\d*)?([eE][+-]?\d+)?$")
WORDS = {"true": True, "false": False, "null": None}


class HydraValueError(ValueError):
    """A value Hydra could not read either: unbalanced braces or quotes."""


def parse(text: str) -> Any:
    """The value of one override (`+key=<text>`)."""
    reader = _Reader(text)
    value = reader.value(top=True)
    reader.skip_space()
    if reader.pos != len(text):
        raise HydraValueError(f"unexpected {text[reader.pos :]!r} after the value")
    return value


def scalar(text: str) -> Any:
    """An unquoted primitive: Hydra's int, float, bool and null, else the text (stripped)."""
    word = text.strip()
    if word.lower() in WORDS:
        return WORDS[word.lower()]
    if word and NUMBER.match(word) and any(c.isdigit() for c in word):
        clean = word.replace("_", "")
        try:
            return int(clean)
        except ValueError:
            return float(clean)
    if word.lower() in ("inf", "+inf", "-inf", "nan"):
        return float(word)
    return word


class _Reader:
    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def value(self, top: bool = False) -> Any:
        self.skip_space()
        char = self.peek()
        if char == "{":
            return self.mapping()
        if char == "[":
            return self.sequence()
        if char in ("'", '"'):
            return self.quoted()
        return self.primitive(stops="" if top else ",]}")

    def primitive(self, stops: str) -> Any:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in stops:
            self.pos += 1
        return scalar(self.text[start : self.pos])

    def quoted(self) -> str:
        quote, self.pos = self.peek(), self.pos + 1
        out = []
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == "\\" and self.pos + 1 < len(self.text):
                out.append(self.text[self.pos + 1])
                self.pos += 2
                continue
            if char == quote:
                self.pos += 1
                return "".join(out)
            out.append(char)
            self.pos += 1
        raise HydraValueError(f"the quote {quote} is never closed")

    def expect(self, char: str) -> None:
        self.skip_space()
        if self.peek() != char:
            raise HydraValueError(f"expected {char!r} at character {self.pos + 1}")
        self.pos += 1

    def mapping(self) -> dict[str, Any]:
        self.expect("{")
        found: dict[str, Any] = {}
        self.skip_space()
        if self.peek() == "}":
            self.pos += 1
            return found
        while True:
            self.skip_space()
            key = self.quoted() if self.peek() in ("'", '"') else self.key()
            self.expect(":")
            found[key] = self.value()
            self.skip_space()
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("}")
            return found

    def key(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ":,}":
            self.pos += 1
        key = self.text[start : self.pos].strip()
        if not key:
            raise HydraValueError(f"a mapping key is missing at character {start + 1}")
        return key

    def sequence(self) -> list[Any]:
        self.expect("[")
        items: list[Any] = []
        self.skip_space()
        if self.peek() == "]":
            self.pos += 1
            return items
        while True:
            items.append(self.value())
            self.skip_space()
            if self.peek() == ",":
                self.pos += 1
                continue
            self.expect("]")
            return items
