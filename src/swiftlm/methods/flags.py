"""What a method of `swiftlm rlhf` reads of the rlhf, grpo and gkd sections, declared by the
method (`MethodFlags`, in its package's `config.py`) and settled when the config is built:
its defaults filled in, and any flag it does not read refused by name. A leaf module (no
torch), so that parsing a command stays fast.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from swiftlm.config.checks import Check, above, check_fields
from swiftlm.errors import ConfigError

# Flags every method reads or that choose the method; `beta` and `loss_type` are read where
# a method declares a default for them.
ALWAYS_READ = frozenset({"rlhf_type", "beta", "loss_type"})


@dataclass(frozen=True)
class MethodFlags:
    """A method's flag facts.

    loss_types: the `--loss_type` values it accepts, its default first (empty: the flag is
        refused); several_loss_types: it combines several (`--loss_type a b`).
    beta: the default of `--beta` (None: the flag is refused), beta_check: its range.
    reads: the other flags of the rlhf, grpo and gkd sections it reads; any other one given
        is an error.
    defaults: its defaults for flags whose section default is None (e.g. temperature).
    check: rules between its flags, called with the rlhf, grpo and gkd sections.
    """

    loss_types: tuple[str, ...] = ()
    several_loss_types: bool = False
    beta: float | None = None
    beta_check: Check = above(0)
    reads: frozenset[str] = frozenset()
    defaults: Mapping[str, Any] = field(default_factory=dict)
    check: Callable[[Any, Any, Any], None] | None = None


def settle_rlhf_section(rlhf, flags: MethodFlags, owners: Mapping[str, MethodFlags]) -> None:
    """The rlhf section's method-dependent values: beta's and loss_type's defaults, their
    checks, and the section's flags the method does not read refused."""
    kind = rlhf.rlhf_type
    if rlhf.beta is None:
        rlhf.beta = flags.beta
    elif flags.beta is None:
        raise ConfigError(f"--beta is not used by --rlhf_type {kind}: drop it")
    if rlhf.beta is not None:
        check_fields(rlhf, beta=flags.beta_check)
    if rlhf.loss_type is None and flags.loss_types:
        rlhf.loss_type = flags.loss_types[0]
    _check_loss_types(rlhf, flags, owners)
    refuse_unread(rlhf, flags, owners, kind)


def settle_online_sections(rlhf, grpo, gkd, flags: MethodFlags, owners) -> None:
    """The grpo and gkd sections: the method's defaults filled, unread flags refused, then
    the method's own rules between its flags."""
    for section in (grpo, gkd):
        for name, value in flags.defaults.items():
            if hasattr(section, name) and getattr(section, name) is None:
                setattr(section, name, value)
        refuse_unread(section, flags, owners, rlhf.rlhf_type)
    if flags.check is not None:
        flags.check(rlhf, grpo, gkd)


def refuse_unread(section, flags: MethodFlags, owners: Mapping[str, MethodFlags], kind) -> None:
    """A flag of `section` given (not its default) that `kind` does not read is an error
    naming the methods that read it."""
    for f in fields(section):
        if f.name in ALWAYS_READ or f.name in flags.reads:
            continue
        default = f.default_factory() if callable(f.default_factory) else f.default
        if getattr(section, f.name) == default:
            continue
        readers = [name for name, other in owners.items() if f.name in other.reads]
        hint = f" (read by --rlhf_type {', '.join(readers)})" if readers else ""
        raise ConfigError(
            f"--{f.name} is not used by --rlhf_type {kind}{hint}: drop it, or pick the method "
            "that reads it (see `swiftlm rlhf --help`)"
        )


def _check_loss_types(rlhf, flags: MethodFlags, owners: Mapping[str, MethodFlags]) -> None:
    kind, types = rlhf.rlhf_type, rlhf.loss_types()
    for loss_type in types:
        if loss_type in flags.loss_types:
            continue
        if not flags.loss_types:
            raise ConfigError(f"--loss_type is not used by --rlhf_type {kind}: drop it")
        others = [name for name, other in owners.items() if loss_type in other.loss_types]
        hint = f"; {loss_type} is a loss of --rlhf_type {'/'.join(others)}" if others else ""
        raise ConfigError(
            f"--loss_type {loss_type}: --rlhf_type {kind} accepts "
            f"{', '.join(flags.loss_types)}{hint}"
        )
    if len(types) > 1 and not flags.several_loss_types:
        several = [name for name, other in owners.items() if other.several_loss_types]
        raise ConfigError(
            f"--loss_type {' '.join(types)}: only --rlhf_type {'/'.join(several)} combines "
            f"several loss types; --rlhf_type {kind} takes one"
        )
