"""The HTML report in a headless browser: the timeline zooms, pans and names what is under the pointer,
and the detail tables are on the page. Skipped where no Chromium is installed."""

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import doctor_traces as dt
import doctor_view_traces as vt
from fuselab.device import STATED_CEILINGS
from fuselab.doctor import analyze_trace
from fuselab.doctor.html import write_html

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None,
                                reason="no headless browser: `apt-get install -y chromium` to render the HTML report")

# Appended to the page: drives the timeline the way a person would and writes what happened into the page.
PROBE = """
<pre id="probe-result"></pre>
<script>
window.addEventListener("load", () => {
  const svg = document.getElementById("timeline"), events = svg.querySelector("g.tl-events");
  const tip = document.getElementById("tl-tip"), box = svg.getBoundingClientRect();
  const axis = () => [svg.querySelector(".tl-axis-left").textContent, svg.querySelector(".tl-axis-right").textContent];
  const state = () => ({transform: events.getAttribute("transform"), axis: axis()});
  const out = {};
  const kernel = [...events.querySelectorAll("rect")]
    .find((r) => r.querySelector("title").textContent.includes("KERNEL"));
  const r = kernel.getBoundingClientRect();
  kernel.dispatchEvent(new MouseEvent("mousemove", {bubbles: true, clientX: r.left + 2, clientY: r.top + 2}));
  out.hover = {text: tip.textContent, display: tip.style.display};
  svg.dispatchEvent(new WheelEvent("wheel", {bubbles: true, cancelable: true, deltaY: -400, clientX: box.left + 150}));
  out.zoomed = state();
  svg.dispatchEvent(new MouseEvent("mousedown", {bubbles: true, clientX: box.left + 600}));
  svg.dispatchEvent(new MouseEvent("mousemove", {bubbles: true, clientX: box.left + 500}));
  window.dispatchEvent(new MouseEvent("mouseup", {bubbles: true}));
  out.panned = state();
  svg.dispatchEvent(new MouseEvent("dblclick", {bubbles: true}));
  out.reset = state();
  document.getElementById("probe-result").textContent = JSON.stringify(out);
});
</script>
"""


def _render(page: Path, tmp_path: Path) -> str:
    """The page's DOM after its scripts ran, as headless Chromium dumps it."""
    command = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync",
               f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1300,2000", "--virtual-time-budget=5000",
               "--dump-dom", page.as_uri()]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout


def _probe(tmp_path: Path, builder, kernel: str = vt.NCCL_ALL_REDUCE) -> tuple[dict, str]:
    """Render the report of `builder`'s trace with PROBE pointing at `kernel`; what PROBE saw, and the DOM."""
    page = tmp_path / "report.html"
    write_html(analyze_trace(builder.write(tmp_path / "t.json"), ceilings=STATED_CEILINGS), page)
    page.write_text(page.read_text().replace("</body>", PROBE.replace("KERNEL", kernel) + "</body>"))
    dom = _render(page, tmp_path)
    found = re.search(r'<pre id="probe-result">(.*?)</pre>', dom, re.DOTALL)
    assert found and found[1], f"the probe did not run; the page as rendered:\n{dom[-2000:]}"
    return json.loads(html.unescape(found[1])), dom


def _scale_and_shift(transform: str) -> tuple[float, float]:
    shift, scale = re.fullmatch(r"translate\(([-\d.e]+) 0\) scale\(([\d.e]+) 1\)", transform).groups()
    return float(scale), float(shift)


def test_timeline_names_the_kernel_under_the_pointer(tmp_path):
    result, _ = _probe(tmp_path, vt.overlapped_streams())
    assert result["hover"]["display"] == "block"
    assert vt.NCCL_ALL_REDUCE in result["hover"]["text"] and "communication (NCCL)" in result["hover"]["text"]


def test_timeline_zooms_pans_and_resets(tmp_path):
    result, _ = _probe(tmp_path, vt.overlapped_streams())
    scale, shift = _scale_and_shift(result["zoomed"]["transform"])
    assert scale > 2 and shift == pytest.approx(150 * (1 - scale))  # about the step's start (x = 150), which stays put
    assert result["zoomed"]["axis"][0] == "0.0 us" and float(result["zoomed"]["axis"][1].split()[0]) < 500
    panned_scale, panned_shift = _scale_and_shift(result["panned"]["transform"])
    assert panned_scale == scale and panned_shift == pytest.approx(shift - 100)  # dragged 100 px left: later on
    assert float(result["panned"]["axis"][0].split()[0]) > 0
    assert result["reset"] == {"transform": "translate(0 0) scale(1 1)", "axis": ["0.0 us", "1000 us"]}


def test_detail_tables_are_on_the_rendered_page(tmp_path):
    result, dom = _probe(tmp_path, vt.training_step(), "fused_adamw_kernel")
    assert "aten::_fused_adamw_: 150.0 us" in result["hover"]["text"]
    for heading in ("top kernels", "GPU time by phase and module", "GPU time by record_function range"):
        assert f"<h2>{heading}" in dom
    assert "Optimizer.step#AdamW.step" in dom and "ui.perfetto.dev" in dom


def test_sync_bound_page_renders_its_syncs(tmp_path):
    result, dom = _probe(tmp_path, dt.sync_bound(), "sm90_xmma_gemm")
    assert dom.count("`.item()` at train.py:42 (loop): blocked 19.0 us") == 10
    hover = result["hover"]["text"]
    assert hover.startswith("aten::mm: 20.0 us") and "sm90_xmma_gemm_bf16bf16_bf16f32" in hover
