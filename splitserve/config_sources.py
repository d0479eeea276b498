"""Where subcommand options come from, in order of precedence:

    command line  >  SPLITSERVE_<OPTION> environment variables  >  --config FILE.yaml  >  built-in defaults

`--config` takes a YAML mapping of option names (`block-size` or `block_size`)
to values. Unknown keys and unconvertible values are errors that name the key,
not silent no-ops. Applied to every `splitserve` subcommand by the CLI.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

ENV_PREFIX = "SPLITSERVE_"


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """dest -> action for every option that takes a value or is a flag."""
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def _convert(action: argparse.Action, value: Any, source: str) -> Any:
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{source}: expected true or false, got {value!r}")
    if isinstance(action, argparse._AppendAction):
        items = value if isinstance(value, list) else [v for v in str(value).split(",") if v]
        return [action.type(v) if action.type and isinstance(v, str) else v for v in items]
    if action.type is not None and isinstance(value, str):
        try:
            value = action.type(value)
        except (TypeError, ValueError):
            raise ValueError(f"{source}: {value!r} is not a valid value for --{action.dest.replace('_', '-')}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{source}: {value!r} is not one of {list(action.choices)}")
    return value


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.yaml",
        help=f"YAML file of option: value pairs; {ENV_PREFIX}<OPTION> variables and flags override it",
    )


def apply_config_sources(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Set the parser's defaults from the config file and the environment."""
    options = _options(parser)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=os.environ.get(ENV_PREFIX + "CONFIG"))
    known, _ = pre.parse_known_args(argv)
    defaults: dict[str, Any] = {}
    if known.config:
        defaults.update(_from_file(Path(known.config), options))
    for dest, action in options.items():
        if dest == "config":
            continue
        name = ENV_PREFIX + dest.upper()
        if name in os.environ:
            defaults[dest] = _convert(action, os.environ[name], name)
    parser.set_defaults(**defaults)


def _from_file(path: Path, options: dict[str, argparse.Action]) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"--config: {str(path)!r} does not exist") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"--config: {str(path)!r} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"--config: {str(path)!r} must hold a mapping of option: value, got {type(data).__name__}")
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        action = options.get(dest)
        if action is None or dest == "config":
            raise ValueError(f"--config: unknown option {key!r} in {str(path)!r}")
        out[dest] = _convert(action, value, f"--config {path.name}: {key}")
    return out
