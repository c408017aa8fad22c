"""The config package stays readable: no module over 600 lines (issue 30's bar), and the
run-level keys of the three commands are declared once (``RunSettings``)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import lmrl.config
from lmrl.config.flow import FlowTrainerConfig
from lmrl.config.run import RunSettings
from lmrl.config.schema import TrainerConfig
from lmrl.config.sft import SFTTrainerConfig

MAX_LINES = 600


def test_no_config_module_is_over_600_lines():
    package = Path(lmrl.config.__file__).parent
    long = {
        p.name: n
        for p in package.glob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by meaning: {long}"


def test_every_command_s_trainer_section_inherits_the_run_keys():
    run_keys = {f.name for f in dataclasses.fields(RunSettings)}
    for section in (TrainerConfig, SFTTrainerConfig, FlowTrainerConfig):
        assert issubclass(section, RunSettings)
        assert run_keys <= {f.name for f in dataclasses.fields(section)}
