"""``tooleffect --help`` and each group's ``--help`` list every command, and
each group's description names every command under it, at 80 columns."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from celery_tooleffect.admin.cli import main, tooleffect

GROUPS = [name for name, command in tooleffect.commands.items()
          if isinstance(command, click.Group)]


def _help(*args: str) -> str:
    ran = CliRunner().invoke(tooleffect, [*args, "--help"], env={"COLUMNS": "80"},
                             terminal_width=80)
    assert ran.exit_code == 0, ran.output
    return ran.output


def test_the_top_help_names_every_command_and_cuts_none() -> None:
    shown = _help()
    description, listed = shown.split("Commands:")
    assert set(tooleffect.commands) == {"dlq", "approvals", "audit", "runs", "tools", "store",
                                        "flower", "mcp"}
    for name, command in tooleffect.commands.items():
        assert f"({name})" in " ".join(description.split())
        line = next(line for line in listed.splitlines() if line.split()[:1] == [name])
        assert not line.endswith("..."), line
        assert command.get_short_help_str(limit=200) in line
    # The console script says the same.
    assert "approvals" in CliRunner().invoke(main, ["--help"]).output


@pytest.mark.parametrize("group", GROUPS)
def test_a_groups_help_names_each_of_its_commands(group: str) -> None:
    command = tooleffect.commands[group]
    assert isinstance(command, click.Group)
    description, listed = _help(group).split("Commands:")
    for name in command.commands:
        assert name in description, (group, name)
        assert any(line.split()[:1] == [name] for line in listed.splitlines())
