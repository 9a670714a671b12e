"""The Flower app that ``flwr run`` deploys, shipped with dpfit and written out with settings.

``flwr_app/pyproject.toml`` (package data) is a complete app: its components are
``dpfit.federated.app:server_app`` and ``dpfit.federated.client:app``, and its run config lists
every setting of ``TaskConfig`` and ``ServerConfig`` (hyphenated names, library defaults), so
``flwr run <dir> --run-config "key=value"`` can override any of them. ``write_app`` writes a
copy whose run config holds the settings of a ``dpfit federated`` command line
(``dpfit federated --write-app DIR ...``).
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

APP_DIR = Path(__file__).with_name("flwr_app")
TEMPLATE = APP_DIR / "pyproject.toml"
CONFIG_TABLE = "[tool.flwr.app.config]"


class AppTemplateError(RuntimeError):
    """The shipped app template is missing or malformed (a broken installation)."""


def run_config(server: Any, task: Any, output: str = "") -> dict[str, Any]:
    """Every setting as the ServerApp reads it from the run config (``app._from_run_config``).

    Unset (None) settings are left out: TOML has no null, and the ServerApp then uses the
    dataclass default, which is None. Tuples are written as comma-separated strings.
    """
    config: dict[str, Any] = {}
    for obj in (task, server):
        for f in fields(obj):
            value = getattr(obj, f.name)
            if value is None:
                continue
            if isinstance(value, tuple):
                value = ",".join(repr(float(x)) for x in value)
            key = f.name.replace("_", "-")
            if key in config and config[key] != value:
                raise ValueError(f"{key} differs between the task ({config[key]}) and server")
            config[key] = value
    config["output"] = output
    return config


def _template_head() -> str:
    if not TEMPLATE.exists():
        raise AppTemplateError(f"{TEMPLATE} is missing; reinstall dpfit")
    text = TEMPLATE.read_text()
    head, sep, _ = text.partition(CONFIG_TABLE)
    if not sep:
        raise AppTemplateError(f"{TEMPLATE} has no {CONFIG_TABLE} table; reinstall dpfit")
    return head


def render_pyproject(config: dict[str, Any]) -> str:
    """The template with its run-config table (always the last table) replaced by ``config``."""
    import tomli_w  # a dependency of flwr

    return _template_head() + CONFIG_TABLE + "\n" + tomli_w.dumps(config)


def write_app(directory: str | Path, server: Any, task: Any, output: str = "") -> Path:
    """Write ``directory/pyproject.toml``: the shipped app with these settings as run config."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "pyproject.toml"
    path.write_text(render_pyproject(run_config(server, task, output)))
    return path


def write_template() -> Path:
    """Rewrite the shipped template's run config from the library defaults; run it after a
    setting is added to ``TaskConfig`` or ``ServerConfig`` (a test checks they agree)."""
    from dpfit.federated.server_config import ServerConfig
    from dpfit.federated.task_config import TaskConfig

    return write_app(APP_DIR, ServerConfig(), TaskConfig())
