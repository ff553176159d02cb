"""The launch.json the docs give for attaching to the ranks of a job (docs/multirank.md)
uses the extension's real debug type and attach attributes (vscode-extension/package.json),
one configuration a rank on PORT+R, started together by a compound."""
from __future__ import annotations

import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _launch_jsons(page: Path) -> list:
    blocks = re.findall(r"```json\n(.*?)```", page.read_text(), re.S)
    return [json.loads(b) for b in blocks if '"configurations"' in b]


def test_the_multirank_launch_json_attaches_one_session_a_rank():
    debugger = json.loads((REPO / "vscode-extension" / "package.json").read_text())[
        "contributes"]["debuggers"][0]
    attach = debugger["configurationAttributes"]["attach"]["properties"]
    (launch,) = _launch_jsons(REPO / "docs" / "multirank.md")
    configs = launch["configurations"]
    assert len(configs) == 2
    for rank, config in enumerate(configs):
        assert config["type"] == debugger["type"] and config["request"] == "attach"
        # nothing but the extension's attach attributes (and every configuration's own)
        assert set(config) - {"type", "request", "name"} <= set(attach), config
        assert set(config["connect"]) <= set(attach["connect"]["properties"])
        assert config["connect"]["port"] == 5678 + rank          # --listen 5678: PORT+R
        assert isinstance(config["connect"]["port"], int)
    (compound,) = launch["compounds"]
    assert compound["configurations"] == [c["name"] for c in configs]
    # the command line the page gives listens where the configurations attach
    assert "torchrun --nproc-per-node 2 -m mldebug --listen 5678 --wait-for-client" in (
        REPO / "docs" / "multirank.md").read_text()
