"""Shared fixtures: the `attnforge` command for plan round trips, and the "attnforge" logger at DEBUG."""
import logging
import os
import pathlib
import shutil

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _find_cli():
    explicit = os.environ.get("ATTNFORGE_CLI")
    if explicit:
        return explicit, True
    for candidate in (REPO / "build" / "attnforge", REPO / "build-python" / "attnforge"):
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate), False
    return shutil.which("attnforge"), False


@pytest.fixture(scope="session")
def cli():
    """Path of the built `attnforge` command (ATTNFORGE_CLI, else build/attnforge, else PATH)."""
    path, explicit = _find_cli()
    if explicit and not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"ATTNFORGE_CLI={path} is not an executable file")
    if not path:
        pytest.skip("the attnforge command was not found: build it (`make build`) or set ATTNFORGE_CLI=/path/to/attnforge")
    return path


@pytest.fixture
def af_log(caplog):
    """caplog with the "attnforge" logger at DEBUG (where the provider's rejections go)."""
    caplog.set_level(logging.DEBUG, logger="attnforge")
    return caplog
