"""The user-error hierarchy: one base the runner maps to exit 2 and one line, wherever it is raised.

A *user error* is bad input that the user can fix - a config value, a mesh the devices cannot
form, a checkpoint or file that cannot be read, data out of range, a missing optional extra. Its
message is one readable line that names the bad value (and the file, field or line it came from)
and what is valid. ``python -m jaxflow.run`` prints ``error: <message>`` and exits 2 for any
:class:`UserError`, raised while the flags are parsed, while the config is built, or inside an
experiment; a fresh run that fails that way removes what it created.

    UserError
      ConfigError        (jaxflow.config)        a config name, override or value
      MeshError          (jaxflow.mesh)          a mesh the devices cannot form
      CheckpointError    (jaxflow.checkpoint)    a run checkpoint missing or unreadable
      FileFormatError    (here)                  a user-given file: HF checkpoint, tokenizer,
                                                 task file, ratings file, corpus
      DataError          (here)                  values out of range for what holds them
      MissingExtraError  (here)                  an optional dependency not installed

Library code keeps the builtin base it had (``ValueError`` for bad values, ``RuntimeError`` for
state) as a second base, so ``except ValueError`` in a notebook still catches it.
"""

from __future__ import annotations

import os


class UserError(Exception):
    """Bad input the user can fix; the message is one line naming the value and what is valid."""


class FileFormatError(UserError, ValueError):
    """A user-given file that cannot be used; the message names the file and the field, line or
    tensor at fault."""


class DataError(UserError, ValueError):
    """Values outside the range of what will hold or use them (e.g. an id that does not fit
    int32, a negative id); the message names the value, where it came from and the valid range."""


class MissingExtraError(UserError, RuntimeError):
    """An optional dependency (a ``pyproject.toml`` extra) is not installed; the message holds
    the install command. The runner turns it into exit code 2 and that one line."""


def one_line(message: object) -> str:
    """``message`` as one line (whitespace runs, newlines included, become one space)."""
    return " ".join(str(message).split())


def read_text(path: "str | os.PathLike", *, what: str = "file") -> str:
    """The text of ``path`` decoded as UTF-8 (a leading UTF-8 byte-order mark dropped).

    Raises:
      FileFormatError: ``path`` is missing, not a file, or not UTF-8 (names the byte offset and
        the valid encoding).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileFormatError(f"{what} {path!r} does not exist or is not a file")
    with open(path, "rb") as f:
        raw = f.read()
    return decode_utf8(raw, path, what=what)


def decode_utf8(raw: bytes, path: str, *, what: str = "file") -> str:
    """``raw`` (the bytes of ``path``) as UTF-8 text without a byte-order mark; FileFormatError
    naming ``path`` and the offending byte offset otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FileFormatError(
            f"{what} {path!r} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
            "valid: UTF-8 (with or without a byte-order mark)") from None
    return text[1:] if text.startswith("\ufeff") else text


def text_lines(path: "str | os.PathLike", *, what: str = "file"):
    """Yields ``(line_number, line)`` of the text file ``path`` (1-based, newline kept), read
    as UTF-8 with a leading byte-order mark dropped, streaming (for files too large to hold).

    Raises:
      FileFormatError: ``path`` is missing or not a file, or a line is not UTF-8 (names the
        line).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileFormatError(f"{what} {path!r} does not exist or is not a file")
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.startswith(b"\xef\xbb\xbf"):
                raw = raw[3:]
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise FileFormatError(
                    f"{what} {path!r} line {number} is not UTF-8 text (byte 0x{raw[e.start]:02x} "
                    f"at column {e.start + 1}); valid: UTF-8 (with or without a byte-order "
                    "mark)") from None

