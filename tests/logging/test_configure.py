"""``configure_logging``: lmrl's INFO records on stderr, other libraries' INFO not (the root
level is left alone), once each however often it is called. In a fresh process, since
pytest configures the root logger of this one."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import logging
from lmrl.logging import configure_logging

configure_logging(logging.INFO)
configure_logging(logging.INFO)  # a second command in the same process
logging.getLogger("torch._subclasses.fake_tensor").info("FakeTensor cache stats")
logging.getLogger("transformers").info("other INFO")
logging.getLogger("lmrl.trainer").info("step 1 done")
logging.getLogger("lmrl.trainer").debug("lmrl DEBUG")
logging.getLogger("torch").warning("other WARNING")
print(logging.getLogger().level)
"""


def test_lmrl_info_shows_once_and_other_libraries_info_does_not():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(30)  # the root logger stays at WARNING
    lines = proc.stderr.splitlines()
    assert lines.count("INFO lmrl.trainer: step 1 done") == 1, proc.stderr
    assert "other WARNING" in lines  # other libraries' warnings still show
    for hidden in ("FakeTensor cache stats", "other INFO", "lmrl DEBUG"):
        assert hidden not in proc.stderr, proc.stderr
    assert len(lines) == 2, proc.stderr


def test_a_warning_level_hides_lmrl_info_too():
    script = SCRIPT.replace("configure_logging(logging.INFO)", "configure_logging('WARNING')")
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["other WARNING"]
