"""The documentation stays true: its links resolve, its cluster files and command lines parse."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from psflow.cluster import ClusterSpec, resolve

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = _BLOCK.sub("", page.read_text())  # a '#' line in a code block is no heading
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def test_slug_follows_github() -> None:
    assert slug('Synchronous mode (`mode="sync"`)') == "synchronous-mode-modesync"
    assert slug("Towers: several local devices") == "towers-several-local-devices"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.name}: " + "; ".join(broken)


def test_every_migration_row_links_to_the_page_that_shows_it() -> None:
    lines = (ROOT / "docs" / "migrating.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| ")][2:]  # past the head and rule
    assert len(rows) >= 10
    names = " ".join(rows)
    for tf_name in (
        "ClusterSpec",
        "tf.train.Server",
        "replica_device_setter",
        "MonitoredTrainingSession",
        "SyncReplicasOptimizer",
        "tf.train.Saver",
        "embedding_lookup",
    ):
        assert tf_name in names, tf_name
    assert all(_LINK.search(row) for row in rows), [r for r in rows if not _LINK.search(r)]


def test_the_cluster_files_in_the_docs_parse(tmp_path: Path) -> None:
    blocks = [
        (lang, body)
        for lang, body in _BLOCK.findall((ROOT / "docs" / "cluster.md").read_text())
        if lang in ("yaml", "json")
    ]
    assert len(blocks) == 2
    specs = []
    for i, (lang, body) in enumerate(blocks):
        path = tmp_path / f"cluster{i}.{lang}"
        path.write_text(body)
        specs.append(ClusterSpec.from_file(path))
    (jobs_only, no_task), (with_chief, task) = specs
    assert no_task is None and jobs_only.num_tasks("ps") == 2 and jobs_only.num_tasks("worker") == 2
    assert task is not None and str(task) == "worker:1" and str(with_chief.chief) == "chief:0"
    # The jobs-only file plus a task from the flags, as the page says.
    ctx, rest = resolve(
        [
            "--cluster_file",
            str(tmp_path / "cluster0.yaml"),
            "--job_name",
            "ps",
            "--task_index",
            "1",
        ],
        environ={},
    )
    assert str(ctx.task) == "ps:1" and ctx.address == "10.0.0.2:2222" and rest == []


def test_the_command_lines_for_several_machines_parse() -> None:
    (body,) = [
        b
        for lang, b in _BLOCK.findall((ROOT / "docs" / "cluster.md").read_text())
        if lang == "bash"
    ]
    commands = [shlex.split(line) for line in body.splitlines() if line.startswith("python ")]
    tasks = []
    for argv in commands:
        ctx, rest = resolve(argv[2:], environ={})
        assert rest == []
        tasks.append((str(ctx.task), ctx.address, ctx.is_chief))
    assert tasks == [
        ("ps:0", "10.0.0.1:2222", False),
        ("ps:1", "10.0.0.2:2222", False),
        ("worker:0", "10.0.0.3:2222", True),
        ("worker:1", "10.0.0.4:2222", False),
    ]
