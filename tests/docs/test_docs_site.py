"""The documentation site: `mkdocs build --strict` passes (a broken link, a
missing page or a bad anchor fails it), and the generated reference pages
name every `serve` flag with its environment variable, every metric the
code defines and every error kind. Also `serve --help`'s topics."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docs_blocks import marked_blocks
from support import REPO

from engine_adapter import errors as kinds
from server.cli import main as cli_main
from server.settings import Settings
from server.settings_cli import TOPICS, flag_of, topic_of


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert r.returncode == 0, r.stderr[-4000:]
    return out


def _page(site: Path, rel: str) -> str:
    return (site / rel / "index.html").read_text()


def _text(site: Path, rel: str) -> str:
    """A page's text as a reader sees it (code blocks' highlighting spans removed)."""
    return html.unescape(re.sub(r"<[^>]+>", "", _page(site, rel)))


def test_every_flag_is_in_the_reference(site: Path) -> None:
    html = _page(site, "reference/flags")
    missing = [
        name for name in Settings.model_fields
        if f"<code>{flag_of(name)}</code>" not in html or f"<code>NPUGW_{name.upper()}</code>" not in html
    ]
    assert not missing, missing


# Every metric name a collector or metric object is built with, in the source.
_METRIC_DEF = re.compile(
    r"\b(?:Counter|Gauge|Histogram|Summary|Info|Enum|(?:Counter|Gauge|Histogram|Summary|Info|StateSet|Unknown)"
    r"MetricFamily)\(\s*(?:name=)?[\"']([a-zA-Z_:][a-zA-Z0-9_:]*)[\"']",
)


def _metrics_in_source() -> set[str]:
    names: set[str] = set()
    for part in ("server", "engine_adapter"):
        for path in (REPO / part).rglob("*.py"):
            names.update(_METRIC_DEF.findall(path.read_text()))
    return names


def test_every_metric_is_in_the_reference(site: Path) -> None:
    from server.docs_gen import metric_rows

    html = _page(site, "reference/metrics")
    exported = {row[0] for row in metric_rows()}
    in_source = _metrics_in_source()
    assert len(in_source) >= 40 and {"vllm:num_requests_running", "npugw_queue_depth"} <= in_source
    assert {"npu_memory_usage_bytes", "npugw_device_memory_bytes"} <= exported  # built with computed names
    missing = sorted(n for n in exported | in_source if f"<code>{n}</code>" not in html)
    assert not missing, missing


def test_every_error_kind_is_in_the_reference(site: Path) -> None:
    html = _page(site, "reference/errors")
    found = [c.__name__ for c in vars(kinds).values() if isinstance(c, type) and issubclass(c, kinds.GatewayError)]
    assert len(found) >= 15
    assert [n for n in found if f"<code>{n}</code>" not in html] == []
    assert "529 <code>overloaded_error</code>" in html  # Anthropic's queue full


def test_deploy_guides_and_promql_are_pages(site: Path) -> None:
    assert "sudo setsebool -P httpd_can_network_connect 1" in _text(site, "troubleshooting")
    assert "(13: Permission denied)" in _text(site, "troubleshooting")
    assert "HCCL" in _text(site, "deploy/ray")
    assert "least_conn" in _text(site, "deploy/nginx")
    promql = _text(site, "reference/promql")
    assert "vllm:generation_tokens_total" in promql and "NPUMemoryHigh" in promql


def test_examples_are_marked() -> None:
    blocks = marked_blocks()
    langs = {b.lang for b in blocks}
    assert langs == {"bash", "python"}, langs
    text = "\n".join(b.code for b in blocks)
    for api in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/generate", "responses.create",
                "messages.create", "chat.completions.create"):
        assert api in text, api


def test_help_is_grouped_by_topic(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["serve", "--help"])
    out = capsys.readouterr().out
    headings = [ln[:-1] for ln in out.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert headings[1:] == list(TOPICS) or headings[1:] == [*TOPICS, "other"], headings
    sections = {h: "" for h in headings}
    current = ""
    for ln in out.splitlines():
        if ln[:-1] in sections and ln.endswith(":"):
            current = ln[:-1]
        elif current:
            sections[current] += ln + "\n"
    for flag, topic in (("--model ", "engine"), ("--max-queue-size", "queue and limits"),
                        ("--routing-policy", "routing"), ("--api-keys-file", "auth"),
                        ("--access-log-format", "observability"), ("--port", "deployment")):
        assert flag in sections[topic], (flag, topic)


def test_topic_of() -> None:
    assert topic_of("upstream_read_timeout") == "routing"
    assert topic_of("metrics_api_key") == "auth"  # an exact name wins over a prefix
    assert topic_of("no_such_setting_xyz") == "other"
    assert "other" not in {topic_of(n) for n in Settings.model_fields}


def test_troubleshooting_names_the_refusals_the_code_prints() -> None:
    page = (REPO / "docs" / "troubleshooting.md").read_text()
    source = "".join(p.read_text() for p in (REPO / "server").glob("*.py"))
    quoted = re.findall(r"`npu-gateway: ([^`]+?)`", page)
    assert len(quoted) >= 4
    for message in quoted:
        head = re.split(r"[A-Z]{2,}|N\b|:\s", message)[0].strip()  # up to the first placeholder
        assert head and head in source, message
