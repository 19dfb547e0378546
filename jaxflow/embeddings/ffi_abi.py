"""The XLA FFI C ABI that the host kernels' handlers (``host_kernel``) read by fixed offsets,
checked against the ``xla/ffi/api/c_api.h`` that jaxlib ships (``jax.ffi.include_dir()``).

The handlers are numba ``cfunc``s: they see the call frame as int64 words, so they hard-code
where ``XLA_FFI_CallFrame``'s ``stage`` / ``args`` / ``rets`` and ``XLA_FFI_Buffer``'s
``data`` / ``rank`` / ``dims`` lie. :func:`check_header` confirms, once at load, that the
installed header declares the API major version and exactly the fields (in order) those
offsets assume; the handlers then also compare every ``struct_size`` XLA passes with
:data:`STRUCT_SIZES` and touch no buffer on a mismatch. ``host_kernel.unavailable`` turns a
mismatch into a fallback to XLA with one warning.
"""

from __future__ import annotations

import os
import re

import jax

__all__ = ["API_MAJOR", "FIELDS", "STRUCT_SIZES", "check_header", "header_path", "struct_fields"]

#: the FFI API major version the handlers were written for (minor bumps only append fields)
API_MAJOR = 0
#: the fields, in order, of every struct the handlers read or write (``c_api.h``, API 0.3)
FIELDS = {
    "XLA_FFI_Extension_Base": ("struct_size", "type", "next"),
    "XLA_FFI_Api_Version": ("struct_size", "extension_start", "major_version", "minor_version"),
    "XLA_FFI_Metadata": ("struct_size", "api_version", "traits", "state_type_id"),
    "XLA_FFI_Metadata_Extension": ("extension_base", "metadata"),
    "XLA_FFI_Buffer": ("struct_size", "extension_start", "dtype", "data", "rank", "dims"),
    "XLA_FFI_Args": ("struct_size", "extension_start", "size", "types", "args"),
    "XLA_FFI_Rets": ("struct_size", "extension_start", "size", "types", "rets"),
    "XLA_FFI_Attrs": ("struct_size", "extension_start", "size", "types", "names", "attrs"),
    "XLA_FFI_CallFrame": ("struct_size", "extension_start", "api", "ctx", "stage", "args", "rets",
                          "attrs", "future"),
}
#: ``XLA_FFI_STRUCT_SIZE`` (bytes up to the struct's traits field, 64-bit) of the structs
#: whose ``struct_size`` the handlers compare on every call
STRUCT_SIZES = {"XLA_FFI_CallFrame": 168, "XLA_FFI_Args": 40, "XLA_FFI_Rets": 40,
                "XLA_FFI_Buffer": 48, "XLA_FFI_Metadata_Extension": 32}


def header_path() -> str:
    """The ``c_api.h`` of the installed jaxlib (the one its XLA runtime was built with)."""
    return os.path.join(jax.ffi.include_dir(), "xla", "ffi", "api", "c_api.h")


def struct_fields(text: str, name: str) -> tuple[str, ...] | None:
    """The member names, in order, of ``struct name { ... };`` in header ``text`` (comments
    dropped; the last identifier before each ``;``), or None when it is not declared."""
    match = re.search(r"\bstruct\s+" + re.escape(name) + r"\s*\{([^{}]*)\}\s*\w*\s*;", text)
    if match is None:
        return None
    body = re.sub(r"//[^\n]*|/\*.*?\*/", "", match.group(1), flags=re.S)
    return tuple(re.findall(r"(\w+)\s*(?:\[[^\]]*\])?\s*;", body))


def check_header(path: str | None = None) -> str | None:
    """Why the handlers' fixed offsets do not fit the header at ``path`` (default
    :func:`header_path`), or None when its major version and every struct of :data:`FIELDS`
    match."""
    path = header_path() if path is None else path
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        return f"cannot read the XLA FFI header {path} ({e.strerror})"
    major = re.search(r"#define\s+XLA_FFI_API_MAJOR\s+(\d+)", text)
    if major is None or int(major.group(1)) != API_MAJOR:
        got = "missing" if major is None else major.group(1)
        return f"XLA FFI API major version {got} in {path}; the handlers read version {API_MAJOR}"
    for name, want in FIELDS.items():
        got = struct_fields(text, name)
        if got != want:
            return f"{name} in {path} has fields {got}; the handlers read {want}"
    return None
