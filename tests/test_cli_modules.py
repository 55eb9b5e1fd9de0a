"""How the ``graphdeck`` command is put together (issue 37 item 4): graphdeck/cli.py only assembles
the group from each command module's ``COMMANDS``; command modules take shared helpers from
graphdeck/cli_common.py only (pyproject's import-linter contract ``cli-commands``, run by
tests/test_layers.py). Here: every ``graphdeck/cli_*.py`` module is registered and inside that
contract (a new module left out would escape it), and no command shadows another on the group."""

from __future__ import annotations

import click
import tomllib

from tests.conftest import REPO


def _command_module_names() -> list[str]:
    return sorted(f"graphdeck.{p.stem}" for p in (REPO / "graphdeck").glob("cli_*.py") if p.stem != "cli_common")


def test_every_command_module_is_registered_and_in_the_cli_contract():
    from graphdeck import cli

    on_disk = _command_module_names()
    assert sorted(m.__name__ for m in cli.COMMAND_MODULES) == on_disk, "list it in graphdeck/cli.py COMMAND_MODULES"
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["id"] == "cli-commands")["layers"]
    assert [layers[0], layers[-1]] == ["graphdeck.cli", "graphdeck.cli_common"], layers
    middle = sorted(m.strip() for m in layers[1].split("|"))
    assert middle == on_disk, "list the module in pyproject's cli-commands contract (its middle layer)"


def test_the_group_holds_each_modules_commands_once():
    from graphdeck import cli

    listed = [c for m in cli.COMMAND_MODULES for c in m.COMMANDS]
    assert all(isinstance(c, click.Command) for c in listed), listed
    names = [c.name for c in listed]
    assert len(names) == len(set(names)), f"two modules define the same command: {sorted(names)}"
    assert cli.main.commands == {c.name: c for c in listed}
