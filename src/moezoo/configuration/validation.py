"""Field checks shared by the zoo's configuration classes.

Each `require_*` takes the config and the names of its fields, and raises a `ValueError` naming the class and the
field, so an invalid value fails at construction with a message that says what to fix. Values that cannot have come
from a valid config (`True` where an int is declared, `"false"` where a bool is, `nan`) are refused too: they are
what a hand-edited `config.json` produces.
"""

from __future__ import annotations

import math

from transformers.activations import ACT2FN


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value) -> bool:
    return is_int(value) and value > 0


def is_non_negative_int(value) -> bool:
    return is_int(value) and value >= 0


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _field(config, name: str) -> str:
    return f"{type(config).__name__}.{name}"


def require_bools(config) -> None:
    """Every field the class declares `bool` must be one: a string such as "false" (from a hand-edited config) is
    truthy and would silently switch the option on."""
    for name, declared_type in type(config).__annotations__.items():
        value = getattr(config, name)
        if declared_type is bool and not isinstance(value, bool):
            raise ValueError(f"{_field(config, name)} must be True or False, got {value!r}")


def require_finite(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not is_number(value):
            raise ValueError(f"{_field(config, name)} must be a finite number, got {value!r}")


def require_positive_ints(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not is_positive_int(value):
            raise ValueError(f"{_field(config, name)} must be a positive integer, got {value!r}")


def require_non_negative_ints(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not is_non_negative_int(value):
            raise ValueError(f"{_field(config, name)} must be an integer >= 0, got {value!r}")


def require_non_negative(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not is_number(value) or value < 0:
            raise ValueError(f"{_field(config, name)} must be a number >= 0, got {value!r}")


def require_positive(config, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not is_number(value) or value <= 0:
            raise ValueError(f"{_field(config, name)} must be a number > 0, got {value!r}")


def require_probability(config, *names: str) -> None:
    """A dropout rate and the like: in [0, 1)."""
    for name in names:
        value = getattr(config, name)
        if not is_number(value) or not 0 <= value < 1:
            raise ValueError(f"{_field(config, name)} must be a probability in [0, 1), got {value!r}")


def require_choice(config, name: str, choices: tuple[str, ...], why: str = "") -> None:
    value = getattr(config, name)
    if value not in choices:
        reason = f" ({why})" if why else ""
        raise ValueError(f"{_field(config, name)}={value!r} is not one of {', '.join(map(repr, choices))}{reason}")


def require_activation(config, name: str) -> None:
    value = getattr(config, name)
    if value not in ACT2FN:
        raise ValueError(
            f"{_field(config, name)}={value!r} is not a known activation; use one of transformers' ACT2FN "
            "names, e.g. 'silu', 'gelu', 'gelu_pytorch_tanh'"
        )


def require_divides(config, divisor_name: str, dividend_name: str) -> None:
    divisor, dividend = getattr(config, divisor_name), getattr(config, dividend_name)
    if dividend % divisor:
        raise ValueError(f"{_field(config, divisor_name)}={divisor} does not divide {dividend_name}={dividend}")


def require_index_list(config, name: str, bound: int, bound_name: str) -> None:
    """A list of distinct indices in [0, bound): layer numbers, vision depths."""
    value = getattr(config, name)
    if (
        not isinstance(value, (list, tuple))
        or not all(is_int(index) and 0 <= index < bound for index in value)
        or len(set(value)) != len(value)
    ):
        raise ValueError(
            f"{_field(config, name)} must be a list of distinct indices in [0, {bound_name}={bound}), got {value!r}"
        )


def require_token_id(config, name: str, vocab_size: int, vocab_name: str = "text_config.vocab_size") -> None:
    value = getattr(config, name)
    if not is_non_negative_int(value) or value >= vocab_size:
        raise ValueError(f"{_field(config, name)} must be a token id in [0, {vocab_name}={vocab_size}), got {value!r}")
