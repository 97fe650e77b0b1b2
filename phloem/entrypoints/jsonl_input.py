"""Reading the JSONL input of a batch job line by line, so that every bad line fails alone.

Both batch commands (`phloem generate`, `phloem run-batch`) read their input here:

- lines are numbered by their physical position in the file (blank lines count; they are
  skipped, not renumbered), so error messages and default ids point at the right line;
- a UTF-8 byte order mark at the start of the file is dropped (editors on Windows write one);
- lines split only at "\\n", "\\r\\n" and "\\r" (JSON strings may hold U+2028 and other
  characters that `str.splitlines` would split at);
- bytes that are not UTF-8 do not abort the job: they are kept in the line's text as lone
  surrogates U+DC80..U+DCFF (Python's "surrogateescape"), and `text_problem` names the first
  one, so the line fails with its id kept while the others run.

Text that holds lone surrogates (undecodable bytes, or "\\ud800"-style JSON escapes) cannot be
written as UTF-8; `clean` makes such text writable (each one becomes U+FFFD).
"""

from __future__ import annotations

import json
import re
from typing import Any

BOM = b"\xef\xbb\xbf"
_SURROGATE = re.compile("[\ud800-\udfff]")


def read_lines(input_path: str) -> list[tuple[int, str]]:
    """(physical line number from 1, text) of the non-blank lines of a file.

    Undecodable bytes stay in the text as lone surrogates (see the module docstring): hash such
    text through `json.dumps` (ASCII escapes) or `str.encode("utf-8", "surrogateescape")`.

    Raises:
        OSError: the file cannot be read.
    """
    with open(input_path, "rb") as f:
        data = f.read()
    if data.startswith(BOM):
        data = data[len(BOM) :]
    out = []
    for number, raw in enumerate(data.splitlines(), start=1):  # bytes split at \n, \r\n, \r only
        text = raw.decode("utf-8", "surrogateescape")
        if text.strip():
            out.append((number, text))
    return out


def text_problem(text: str) -> str | None:
    """Why `text` (one line, as `read_lines` returns it) is not valid UTF-8 text, naming the
    first bad byte and its column; None when it is valid."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        if 0xDC80 <= char <= 0xDCFF:  # an undecodable byte (surrogateescape)
            return f"invalid UTF-8: byte 0x{char - 0xDC00:02x} at column {e.start + 1}"
        return f"invalid Unicode: lone surrogate U+{char:04X} at column {e.start + 1}"
    return None


def value_problem(value: Any) -> str | None:
    """Why a parsed JSON value cannot be used as text: a string in it holds a lone UTF-16
    surrogate (a "\\ud800"-style escape with no partner); None when every string is valid."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return f"invalid Unicode: a string holds a lone surrogate ({e.object[e.start]!a})"
    except (ValueError, RecursionError):
        return "the value is nested too deeply"
    return None


def loads(text: str) -> Any:
    """`json.loads` whose every failure is a ValueError with a one-line message: invalid JSON,
    nesting deeper than the parser's recursion limit, or an integer with more digits than
    Python converts (4,300 by default)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise ValueError("invalid JSON: nested too deeply") from None
    except ValueError as e:  # e.g. an integer literal beyond the int conversion limit
        raise ValueError(f"invalid JSON: {e}") from None


def top_level(text: str, max_depth: int = 16) -> Any:
    """The line's JSON value with everything nested deeper than `max_depth` replaced by null,
    or None when even that does not parse: how a line that `loads` refused as nested too deeply
    still yields its id / custom_id. Walks the text once in Python: for failed lines only."""
    out: list[str] = []
    depth = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if depth <= max_depth:
                out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
            if depth <= max_depth:
                out.append(ch)
        elif ch in "[{":
            depth += 1
            if depth <= max_depth:
                out.append(ch)
            elif depth == max_depth + 1:
                out.append("null")
        elif ch in "]}":
            if depth <= max_depth:
                out.append(ch)
            depth -= 1
        elif depth <= max_depth:
            out.append(ch)
    try:
        return json.loads("".join(out))
    except (ValueError, RecursionError):
        return None


def clean(text: str) -> str:
    """`text` with every lone surrogate replaced by U+FFFD, so it can be written as UTF-8."""
    return _SURROGATE.sub("\ufffd", text)
