"""The one checking kit (`gyre.config.checks`) and the ConfigStore that holds every component config."""

import dataclasses
import math

import pytest

import gyre.config as config
from gyre.config.checks import (
    ConfigError,
    require_bool,
    require_choice,
    require_duration,
    require_int,
    require_number,
)


@pytest.mark.parametrize(
    ("check", "message"),
    [
        (lambda: require_int("a.n", 0, ge=1, note="B"), "a.n=0 is not allowed: expected an integer >= 1 (B)"),
        (lambda: require_int("a.n", True, ge=0), "a.n=True is not allowed: expected an integer >= 0"),
        (lambda: require_int("a.n", 2.0, ge=0), "a.n=2.0 is not allowed: expected an integer >= 0"),
        (
            lambda: require_int("port", 70000, ge=0, le=65535),
            "port=70000 is not allowed: expected an integer in [0, 65535]",
        ),
        (lambda: require_number("x", 0, gt=0, le=1), "x=0 is not allowed: expected a number in (0, 1]"),
        (lambda: require_number("x", 1.0, ge=0, lt=1), "x=1.0 is not allowed: expected a number in [0, 1)"),
        (lambda: require_number("x", False, gt=0), "x=False is not allowed: expected a number > 0"),
        (lambda: require_number("x", math.nan), "x=nan is not allowed: expected a finite number, a number"),
        (lambda: require_duration("t", 0), "t=0 is not allowed: expected a positive number of seconds"),
        (lambda: require_duration("t", -1, allow_zero=True), "t=-1 is not allowed: expected a number of seconds >= 0"),
        (lambda: require_duration("t", math.inf), "t=inf is not allowed: expected a finite number"),
        (lambda: require_bool("b", 1), "b=1 is not allowed: expected a bool"),
        (
            lambda: require_choice("d", "int8", ("float32", "bfloat16")),
            "d='int8' is not allowed: expected one of float32, bfloat16",
        ),
    ],
)
def test_every_helper_names_field_value_and_allowed(check, message):
    with pytest.raises(ConfigError) as info:
        check()
    assert str(info.value).startswith(message)


def test_good_values_pass():
    require_int("n", 3, ge=1, le=3)
    require_number("x", 1, gt=0, le=1)
    require_duration("t", 0.0, allow_zero=True)
    require_bool("b", False)
    require_choice("d", "float32", ("float32",))


def test_every_exported_config_is_a_kw_only_dataclass_in_the_config_store():
    pytest.importorskip("hydra")
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    config.register_configs()
    stored = set()
    pending = [ConfigStore.instance().repo]
    while pending:
        for item in pending.pop().values():
            if isinstance(item, dict):  # a group
                pending.append(item)
            else:
                stored.add(OmegaConf.get_type(item.node))
    schemas = [getattr(config, name) for name in config.__all__ if name.endswith(("Config", "Limits", "Spec"))]
    for schema in schemas:
        assert dataclasses.is_dataclass(schema), schema
        assert all(f.kw_only for f in dataclasses.fields(schema)), schema
        assert schema in stored, f"{schema.__name__} is not registered by register_configs"
