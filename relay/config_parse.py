"""Reading the configuration: a TOML file, its tables checked key by key against the schema
(:mod:`relay.config`), then the value rules (:mod:`relay.config_rules`). An unknown key or a
wrong type raises a :class:`~relay.config.ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, get_type_hints

from relay.config import SECTIONS, Config, ConfigError
from relay.config_rules import validate


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    """Return the value converted to ``annotation`` or raise naming ``key``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if isinstance(value, list):
            # A list for ``str | list[str]`` (listen.address): the list's own check, whose
            # error names the bad element; the union's named only the key, "expected str |
            # list[str], got list" for a list with one bad element (found by review).
            for option in options:
                if typing.get_origin(option) is list:
                    return _check_type(key, value, option)
        for option in options:
            try:
                return _check_type(key, value, option)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {type(value).__name__}")
    if origin is list:
        (item,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__}")
        return [_check_type(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    if annotation is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:
            raise ConfigError(f"{key}: number out of range") from None
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got a boolean")
    if not isinstance(value, annotation):
        raise ConfigError(f"{key}: expected {_type_name(annotation)}, got {type(value).__name__}")
    return value


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", str(annotation))


def _section(name: str, cls: type[Any], raw: Any) -> Any:
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: expected a table")
    hints = get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in known:
            raise ConfigError(f"{name}.{key}: unknown key")
        values[key] = _check_type(f"{name}.{key}", value, hints[key])
    return cls(**values)


def parse(data: dict[str, Any], base_dir: Path = Path()) -> Config:
    sections: dict[str, Any] = {}
    for name, raw in data.items():
        cls = SECTIONS.get(name)
        if cls is None:
            raise ConfigError(f"{name}: unknown section")
        sections[name] = _section(name, cls, raw)
    config = Config(**sections, base_dir=base_dir)
    validate(config)
    return config


def config_sections(config: Config) -> dict[str, dict[str, Any]]:
    """The configuration as the tables of its file (``parse`` reads them back)."""
    return {name: dataclasses.asdict(getattr(config, name)) for name in SECTIONS}


def load(path: str | os.PathLike[str]) -> Config:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 (byte {exc.start}); TOML files are UTF-8") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: invalid TOML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{p}: invalid TOML: nested too deeply") from None
    # Absolute, its links left to each open: a folder swapped by a link (a Kubernetes
    # ConfigMap's "..data", a release symlink) is followed by SIGHUP and by the routes file's
    # polls. Resolved here, relay kept reading the folder of its start, deleted by the
    # update: every reload failed and the routes of that start stayed (found by review).
    p = p.absolute()
    return dataclasses.replace(parse(data, p.parent), source=p)
