"""``loadmaster plan --svg/--html`` and the page's routes, without a browser.

The SVG must parse as XML in the SVG namespace and hold one ``rect.layer`` per placed block (one per decoder
layer among them), coloured by device; ``plan`` with these flags still imports no torch, transformers or FastAPI.
"""

from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx

from service.ui.plan_picture import device_colour

ROOT = Path(__file__).resolve().parents[3]
LLAMA_8B = ROOT / "examples" / "configs" / "llama-3-8b.json"
SVG_NS = "{http://www.w3.org/2000/svg}"


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from service.cli.main import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_the_picture_modules_import_nothing_heavy() -> None:
    """What --svg/--html add to ``loadmaster plan`` costs no torch, transformers or FastAPI import."""
    code = (
        "import sys, service.ui.plan_picture, service.ui.page; "
        "print(','.join(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "", proc.stdout + proc.stderr


def test_svg_has_one_element_per_layer_coloured_by_device(tmp_path: Path) -> None:
    svg_path = tmp_path / "plan.svg"
    args = [
        "plan",
        str(LLAMA_8B),
        "--gpus",
        "1x8GiB",
        "--max-memory",
        "0=8GiB,cpu=8GiB,disk=100GB",
        "--offload-folder",
        str(tmp_path),
        "--svg",
        str(svg_path),
        "--json",
    ]
    proc = _run_cli(*args)
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)
    root = ET.parse(svg_path).getroot()  # valid XML, or this raises
    assert root.tag == f"{SVG_NS}svg"
    layers = [e for e in root.iter(f"{SVG_NS}rect") if e.get("class") == "layer"]
    assert [e.get("data-name") for e in layers] == list(plan["placement"])
    decoder = [e for e in layers if e.get("data-layer") is not None]
    config = json.loads(LLAMA_8B.read_text())
    assert [int(e.get("data-layer")) for e in decoder] == list(range(config["num_hidden_layers"]))
    for e in layers:
        dev = plan["placement"][e.get("data-name")]
        assert e.get("data-device") == str(dev) and e.get("fill") == device_colour(dev)
    assert {e.get("data-device") for e in layers} == {"0", "cpu", "disk"}
    assert len({device_colour(0), device_colour("cpu"), device_colour("disk")}) == 3
    bars = [g for g in root.iter(f"{SVG_NS}g") if g.get("class") == "device-bar"]
    assert [(g.get("data-device"), int(g.get("data-total"))) for g in bars] == [
        (str(b["device"]), b["total"]) for b in plan["budgets"]
    ]
    hops = [p for p in root.iter(f"{SVG_NS}path") if p.get("class") == "hop"]
    devs = [e.get("data-device") for e in layers]
    assert len(hops) == sum(1 for a, b in zip(devs, devs[1:]) if a != b) > 0
    desc = root.find(f"{SVG_NS}desc")
    assert desc is not None and "tokens/s" in (desc.text or "")


def test_html_embeds_the_plan_and_needs_no_network(tmp_path: Path) -> None:
    out = tmp_path / "plan.html"
    proc = _run_cli("plan", str(LLAMA_8B), "--gpus", "2x24GiB", "--html", str(out))
    assert proc.returncode == 0, proc.stderr
    html = out.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "") and "https://" not in html
    boot = html.split('<script type="application/json" id="boot">', 1)[1].split("</script>", 1)[0]
    data = json.loads(boot)
    assert data["offline"] is True and data["svg"].count('class="layer"') == len(data["plan"]["placement"])


def test_get_root_is_the_page_for_browsers_and_405_otherwise(client: httpx.Client) -> None:
    page = client.get("/", headers={"Accept": "text/html,application/xhtml+xml"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="plan-picture"' in page.text
    assert client.get("/ui").status_code == 200
    other = client.get("/", headers={"Accept": "application/json"})
    assert other.status_code == 405 and other.headers.get("allow") == "POST"
    assert other.json()["error_type"] == "validation"
    gen = client.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert gen.status_code == 200 and isinstance(gen.json(), list), "POST / is still TGI's generate"


def test_picture_route_draws_a_plan_and_refuses_other_bodies(client: httpx.Client) -> None:
    plan = client.get("/info").json()["plan"]
    svg = client.post("/ui/picture", json=plan)
    assert svg.status_code == 200 and svg.headers["content-type"].startswith("image/svg+xml")
    assert svg.text.count('class="layer"') == len(plan["placement"])
    bad = client.post("/ui/picture", json={"model": "x"})
    assert bad.status_code == 422 and "not a Plan" in bad.json()["error"]
    junk = client.post("/ui/picture", content=b"{nope", headers={"Content-Type": "application/json"})
    assert junk.status_code == 422 and "not JSON" in junk.json()["error"]
