"""Settings every policy factory receives (so a policy never reads the whole router config)."""

from __future__ import annotations

import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from router.errors import ConfigError

__all__ = ["OptionValue", "PolicySettings"]

OptionValue = str | int | float | bool


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """What a policy may be configured with.

    `options` holds policy-specific settings (`--policy-option KEY=VALUE`, or `policy_options:`
    in YAML); each factory reads the keys it knows with the typed getters below and calls
    `check_options` so a misspelt key fails at startup instead of being ignored.
    """

    seed: int | None = None
    block_units: int = 64
    options: Mapping[str, OptionValue] = field(default_factory=lambda: types.MappingProxyType({}))

    def check_options(self, policy: str, allowed: Collection[str] = ()) -> None:
        """Raise ConfigError when an option this policy does not know was given."""
        unknown = sorted(set(self.options) - set(allowed))
        if unknown:
            known = ", ".join(sorted(allowed)) or "none"
            raise ConfigError(
                f"policy {policy!r} has no option {', '.join(unknown)} (known: {known})"
            )

    def float_option(self, key: str, default: float) -> float:
        value = self.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"policy option {key}: expected a number, got {value!r}")
        return float(value)

    def int_option(self, key: str, default: int) -> int:
        value = self.options.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"policy option {key}: expected an integer, got {value!r}")
        return value
