"""A bench's --dir: made when it does not exist, a clear error when it cannot be."""
from __future__ import annotations

import os

import pytest

from kvstore.bench import scratch_dir
from kvstore.errors import ConfigError


def test_dir_is_made_and_each_run_gets_its_own(tmp_path):
    where = tmp_path / "not" / "yet"
    a, b = scratch_dir("kvstore-x-", str(where)), scratch_dir("kvstore-x-", str(where))
    assert a != b and os.path.dirname(a) == os.path.dirname(b) == str(where)


def test_a_dir_that_cannot_be_made_says_so(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="--dir .*cannot make it"):
        scratch_dir("kvstore-x-", str(blocker / "sub"))
    assert blocker.read_text() == "x"


def test_cli_reports_it_without_a_traceback(tmp_path):
    from click.testing import CliRunner
    from kvstore.cli import main
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = CliRunner().invoke(main, ["bench", "index", "--dir", str(blocker / "sub")])
    assert r.exit_code != 0 and "cannot make it" in r.output and "Traceback" not in r.output
