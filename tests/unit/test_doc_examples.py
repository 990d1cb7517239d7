"""Every params example in the README and the guides (a ```yaml block) is valid params.yaml, merged over the
shipped file as a user would write it in."""

from __future__ import annotations

import re

import pytest
import yaml
from conftest import ROOT

from llmpipe.config import parse_params
from llmpipe.orchestration.scratch import merged_params

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
EXAMPLES = [(page, block) for page in PAGES for block in re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.S | re.M)]


def test_the_pages_have_examples():
    assert {page.name for page, _ in EXAMPLES} >= {"README.md", "finetune.md", "data.md"}


@pytest.mark.parametrize(("page", "block"), EXAMPLES, ids=[f"{p.relative_to(ROOT)}-{i}" for i, (p, _) in enumerate(EXAMPLES)])
def test_example_validates(page, block):
    example = yaml.safe_load(block)
    assert isinstance(example, dict), f"{page.relative_to(ROOT)}: a yaml example is a mapping of params sections"
    parse_params(merged_params(ROOT, example), source=f"{page.relative_to(ROOT)} example")
