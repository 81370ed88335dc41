"""A dataset's table (the keys of the config's `[[dataset]]`) as the TOML text AddDataset takes."""

from __future__ import annotations

import json
import os


def _toml_string(s: str) -> str:
    # A JSON string is a TOML basic string once DEL is escaped too (and no surrogate pairs:
    # characters are written as themselves).
    return json.dumps(s, ensure_ascii=False).replace("\x7f", "\\u007f")


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(int(v))
    if isinstance(v, float):
        return repr(float(v))
    if isinstance(v, (str, os.PathLike)):
        path = os.fspath(v)
        return _toml_string(path if isinstance(path, str) else os.fsdecode(path))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_string(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"{v!r} is not a value of a dataset's table")


def toml_table(table: dict) -> str:
    """`table` as TOML (inline tables for nested ones: the daemon parses any TOML)."""
    return "".join(f"{_toml_string(k)} = {_toml_value(v)}\n" for k, v in table.items())
