"""What the Hydra apps (`gyre.sim`, `gyre.serve`) share: where `conf/` is, and one-line config errors.

A config the user can fix must end in ONE line naming the field, the value and what is allowed, never a
traceback; these helpers produce that line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from gyre.config.checks import ConfigError

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's conf/ (gyre is installed editable)


def to_config(cfg: DictConfig, schema: type):
    """The checked dataclass object of a composed config, or `ConfigError` with the one line to print.

    Missing values and keys no field declares are refused first: `to_object` would quietly fall back to the
    default, or set them as plain attributes."""
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"{missing[0]}=??? is not allowed: expected a value ({missing[0]}=...)")
    unknown = unknown_keys(cfg)
    if unknown:
        raise ConfigError(unknown[0])
    try:
        obj = OmegaConf.to_object(cfg)  # the dataclasses' __post_init__ checks raise ConfigError themselves
    except OmegaConfBaseException as exc:
        raise ConfigError(describe_config_error(exc)) from None
    assert isinstance(obj, schema), type(obj)
    return obj


def describe_config_error(exc: BaseException) -> str:
    """One line for a Hydra or OmegaConf error: the field, the value and what is allowed."""
    from hydra.errors import MissingConfigException  # gyre.config imports only stdlib and omegaconf at load

    if isinstance(exc, MissingConfigException) and exc.missing_cfg_file and exc.options:
        group, _, option = exc.missing_cfg_file.rpartition("/")
        options = [name for name in exc.options if not name.startswith("base_")]  # schemas, not choices
        if group:
            return f"{group}={option!r} is not allowed: expected one of {', '.join(options)}"
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        message = _one_line(str(cause.msg or cause).splitlines()[0])
        if isinstance(cause, ValidationError) and cause.value is not None:
            expected = _NODE_TYPES.get(type(cause.child_node).__name__)
            allowed = f"expected {expected} ({message})" if expected else message
            return f"{cause.full_key}={cause.value!r} is not allowed: {allowed}"
        return f"{cause.full_key}: {message}"
    return _one_line(str(exc))


_NODE_TYPES = {"IntegerNode": "an integer", "FloatNode": "a number", "BooleanNode": "true or false"}


def unknown_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Keys that no dataclass field declares (added with `+key=value`), each described in one line."""
    schema = OmegaConf.get_type(node)
    fields = [f.name for f in dataclasses.fields(schema)] if dataclasses.is_dataclass(schema) else None
    problems = []
    for key in node:
        full_key = f"{prefix}{key}"
        if fields is not None and key not in fields:
            problems.append(
                f"{full_key}={node[key]!r} is not allowed: expected one of the {schema.__name__} fields "
                f"({', '.join(fields)})"
            )
        elif isinstance(child := node[key], DictConfig):
            problems.extend(unknown_keys(child, f"{full_key}."))
    return problems


def _one_line(text: str) -> str:
    lines = [line.strip() for line in str(text).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith("Config search path"))
