# Copyright 2026 The dion3_jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
# ==============================================================================
"""What the README promises about commands, installs and packaging holds.

The README's ```python blocks run in tests/test_doc_snippets.py.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.requirements import Requirement

pytestmark = pytest.mark.tooling

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("dion3_jax", "pallas_kernels")


def bash_commands(text: str) -> list[str]:
    """The commands of every ```bash block, comments and blank lines dropped, in order."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        commands += [line.split("#")[0].strip() for line in block.splitlines()]
    return [c for c in commands if c]


def requirements(names: list[str]) -> dict[str, Requirement]:
    """Parses requirement strings into a dict keyed by the canonical (lower-case) name."""
    parsed = [Requirement(n) for n in names]
    return {r.name.lower().replace("_", "-"): r for r in parsed}


def ci_pins() -> dict[str, str]:
    """``requirements-ci.txt`` as ``{name: exact version}``; every line must be an exact pin."""
    pins = {}
    for line in (ROOT / "requirements-ci.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep and version, f"requirements-ci.txt: {line!r} is not an exact pin"
            pins[name.strip().lower()] = version.strip()
    return pins


def test_first_two_commands_are_the_scripts_ci_runs():
    commands = bash_commands(README)
    assert commands[:2] == ["bash scripts/train.sh", "bash scripts/test.sh"]
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
    for c in commands[:2]:
        assert (ROOT / c.split()[1]).exists(), c


def test_every_extra_the_readme_names_exists():
    named = set(re.findall(r'pip install -e "\.\[(\w+)\]"', README))
    assert {"examples", "test", "triton"} <= named
    assert named <= set(PYPROJECT["project"]["optional-dependencies"])


def test_direct_dependencies_have_upper_bounds():
    project = PYPROJECT["project"]
    deps = list(project["dependencies"])
    deps += [d for extra in project["optional-dependencies"].values() for d in extra]
    for name, req in requirements(deps).items():
        if name in ("jax", "jaxlib", "optax", "flax", "orbax-checkpoint", "numpy"):
            assert any(s.operator in ("<", "<=", "~=", "==") for s in req.specifier), req


def test_ci_pins_lie_in_the_declared_ranges():
    project = PYPROJECT["project"]
    declared = requirements(project["dependencies"] + project["optional-dependencies"]["examples"]
                            + project["optional-dependencies"]["test"])
    pins = ci_pins()
    assert set(pins) == set(declared), "requirements-ci.txt and pyproject.toml list other packages"
    for name, version in pins.items():
        assert declared[name].specifier.contains(version), (name, version, declared[name])


def test_packages_ship_py_typed():
    package_data = PYPROJECT["tool"]["setuptools"]["package-data"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in package_data[package], package


def test_license_is_the_apache_text():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text
    assert "Copyright 2026 The dion3_jax authors" in text


def test_restarts_command_prints_what_the_readme_says():
    line = next(c for c in bash_commands(README) if "dion3_jax.newton_schulz" in c)
    expected = re.search(r"last line: (.*)$", next(
        raw for raw in README.splitlines() if "dion3_jax.newton_schulz --" in raw)).group(1).strip()
    args = line.split()[1:]  # drop "python": run with this interpreter
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == expected


def test_warnings_fail_the_tests_but_jax_s_pallas_triton_notice():
    """pytest turns every warning into an error; the one exception is jax's notice that its
    Pallas Triton backend is deprecated, which it gives on every GPU lowering of a pallas_call."""
    filters = PYPROJECT["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters == ["error",
                       "ignore:The Pallas Triton backend is deprecated:DeprecationWarning"]


def _tests_section() -> str:
    return re.search(r"^## Tests\n(.*?)(?=^## )", README, flags=re.M | re.S).group(1)


def test_readme_lists_every_registered_marker():
    registered = {m.split(":")[0].strip()
                  for m in PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]}
    listed = set(re.findall(r"^- `(\w+)`:", _tests_section(), flags=re.M))
    assert registered == listed, f"pyproject registers {sorted(registered)}, README lists " \
                                 f"{sorted(listed)}"


def test_test_files_of_examples_and_benchmarks_are_tooling():
    """A test file that imports from examples/ or benchmarks/ (or runs their scripts) carries
    the ``tooling`` marker."""
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        text = path.read_text()
        if re.search(r"\"(?:examples|benchmarks)[\"/]", text):
            assert re.search(r"^pytestmark = \[?pytest\.mark\.tooling\b", text, flags=re.M), \
                path.name
