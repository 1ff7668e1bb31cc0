"""The docs site builds with ``--strict``, its links resolve, and every command is run.

Every ``bash`` and ``python`` block in the README and ``docs/`` is marked
(``<!-- NAME:start -->``) and some test reads it by that name through
``tests.support.docs.block``; these tests keep it so. The Docker block cannot run here (no
Docker daemon on CI's machine): its files and build arguments are checked instead.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.docs import DOCS, README, REPO, block, marked_blocks, pages

TESTS = REPO / "tests"


def mkdocs_build(root: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


def test_the_site_builds_strict(tmp_path):
    r = mkdocs_build(REPO, tmp_path / "site")
    assert r.returncode == 0, r.stderr[-3000:]
    built = {
        p.relative_to(tmp_path / "site").as_posix() for p in (tmp_path / "site").rglob("index.html")
    }
    for page in sorted(DOCS.glob("*.md")):
        want = "index.html" if page.stem == "index" else f"{page.stem}/index.html"
        assert want in built, page.name


def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "safety.md", "a") as f:
        f.write("\nSee [the format](no-such-page.md#nowhere).\n")
    r = mkdocs_build(tmp_path, tmp_path / "site")
    assert r.returncode != 0
    assert "no-such-page.md" in r.stderr


def test_every_page_is_in_the_nav():
    nav = yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"]

    def files(item):
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for v in item.values():
                yield from files(v)
        else:
            for v in item:
                yield from files(v)

    assert set(files(nav)) == {p.name for p in DOCS.glob("*.md")}


def test_the_readme_links_resolve():
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README.read_text())
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" not in link:
            assert (REPO / link).exists(), link


def test_every_command_block_is_marked():
    unmarked = []
    for page in pages():
        lines = page.read_text().splitlines()
        inside = False
        for i, line in enumerate(lines):
            if not line.startswith("```"):
                continue
            if not inside and line[3:].strip() in ("bash", "python", "sh", "console"):
                before = next((x for x in reversed(lines[:i]) if x.strip()), "")
                if not re.match(r"<!-- [a-z0-9-]+:start -->", before.strip()):
                    unmarked.append(f"{page.relative_to(REPO)}:{i + 1}")
            inside = not inside
    assert not unmarked, "mark these blocks and run them from a test: " + ", ".join(unmarked)


def test_every_marked_block_is_read_by_a_test():
    sources = "\n".join(p.read_text() for p in TESTS.rglob("*.py") if p.name != "docs.py")
    unread = [
        f"{name} ({page})" for name, page in marked_blocks().items() if f'"{name}"' not in sources
    ]
    assert not unread, "no test reads these blocks: " + ", ".join(unread)


def test_the_docker_block_names_real_files_and_build_arguments():
    """No Docker daemon here: the commands' files, services and build args are checked."""
    commands = [
        shlex.split(c, comments=True)
        for c in block("docker", "bash").replace("\\\n", " ").splitlines()
    ]
    commands = [c for c in commands if c]
    assert len(commands) == 2
    compose = commands[0][commands[0].index("-f") + 1]
    spec = yaml.safe_load((REPO / compose).read_text())
    server = spec["services"]["reshard-server"]["build"]
    dockerfile = (REPO / compose).parent / server["context"] / server["dockerfile"]
    assert dockerfile.is_file()
    build = commands[1]
    declared = set(
        re.findall(r"^ARG (\w+)", (REPO / build[build.index("-f") + 1]).read_text(), re.M)
    )
    args = [build[i + 1].split("=")[0] for i, a in enumerate(build) if a == "--build-arg"]
    assert args and set(args) <= declared


def test_the_two_commands_are_the_makefiles():
    """`make test` is what CI runs; `make demo` runs the module tests/client/test_demo.py runs."""
    lines = [ln.split("#")[0].strip() for ln in block("two-commands", "bash").splitlines()]
    assert lines == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^demo: .*\n\t\$\(PY\) -m reshard_client.demo$", makefile, re.M)
    assert "reshard_client.demo" in (TESTS / "client" / "test_demo.py").read_text()
    assert "make test" in (REPO / ".ci" / "run").read_text()


@pytest.mark.parametrize("name", ["quickstart", "python"])
def test_the_readme_keeps_its_first_examples(name):
    assert block(name)
    assert len(README.read_text().splitlines()) < 150  # a two-minute read
