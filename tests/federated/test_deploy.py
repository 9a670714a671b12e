"""The shipped Flower app: its run config is every setting, and what `--write-app` writes is
read back by the ServerApp as exactly the settings of the command line."""

from __future__ import annotations

import argparse

try:
    import tomllib
except ImportError:  # Python 3.10: flwr's dependency
    import tomli as tomllib

from dpfit.federated.app import _from_run_config
from dpfit.federated.cli import add_arguments, configs, run
from dpfit.federated.client import TaskConfig
from dpfit.federated.deploy import TEMPLATE, run_config
from dpfit.federated.strategy import ServerConfig


def _app(path) -> dict:
    return tomllib.loads(path.read_text())["tool"]["flwr"]["app"]


def test_shipped_template_lists_every_setting_at_its_default():
    app = _app(TEMPLATE)
    assert app["components"] == {
        "serverapp": "dpfit.federated.app:server_app",
        "clientapp": "dpfit.federated.client:app",
    }
    expected = run_config(ServerConfig(), TaskConfig())
    assert app["config"] == expected, (
        "the shipped template's run config is stale: regenerate it with "
        "`python -c 'from dpfit.federated.deploy import write_template; write_template()'`"
    )


def test_write_app_round_trips_the_command_line(tmp_path, capsys):
    argv = ["--method", "adaptive-quantile", "--epsilon", "4", "--clients", "3",
            "--clients-per-round", "2", "--rounds", "7", "--local-mode", "bias",
            "--target-quantile", "0.3", "--seed", "5", "--output", "/srv/out"]  # fmt: skip
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert run(parser.parse_args([*argv, "--write-app", str(tmp_path / "app")])) == 0
    assert "flwr run" in capsys.readouterr().out
    server, task = configs(parser.parse_args(argv))
    rc = _app(tmp_path / "app" / "pyproject.toml")["config"]
    assert _from_run_config(TaskConfig, rc) == task
    assert _from_run_config(ServerConfig, rc) == server
    assert rc["output"] == "/srv/out"
