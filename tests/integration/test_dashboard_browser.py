"""The dashboard in a real browser: Debian's chromium, driven by Selenium through chromedriver.

A real llama-server deployment runs in the sandbox; ``capyctl ui`` forwards a loopback port of
this machine to the sandboxed daemon's management socket (the socket lives under
/var/lib/capyctl-tests, which both sides see), exactly as an operator would open it. The browser
shows the deployment, Park is pressed, and both the unit (systemd in the sandbox, through the
API) and the page must change. Once a wake has restored the prompt cache, the page must fit every
width from a phone's to a laptop's without sideways scrolling. Screenshots are written to
$CAPYCTL_TEST_ARTIFACTS (else the test's tmp directory) and their paths printed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.components import missing

from .capyhost import CAPYCTL

pytestmark = [pytest.mark.sandbox, pytest.mark.llama]

WAIT_S = 60


def _chromium() -> tuple[str, str]:
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        missing("Debian's chromium and chromedriver are not installed: apt-get install chromium chromium-driver "
                "(scripts/setup does)")
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing("selenium is not installed: pip install -e '.[test]'")
    return chromium, driver


def _artifacts(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("CAPYCTL_TEST_ARTIFACTS") or tmp_path) / "dashboard"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# The widths the page must fit without sideways scrolling: a laptop (1,400 px: where a wake's long
# note once pushed the Park, Wake, Stop and Logs buttons out of their card), a smaller one, the
# narrowest that shows the table (narrower, its rows stack), a tablet, a phone.
VIEWPORTS = ((1400, 900, False), (1280, 900, False), (1120, 800, False), (1024, 768, False), (390, 844, True))

# What overflows the page at the current viewport: the document wider than its window, a shown
# button (header, cards) outside its card's box or cut off by a box that scrolls within the card,
# or a card wider than the window.
OVERFLOW_JS = """
const doc = document.documentElement, found = [];
if (doc.scrollWidth > doc.clientWidth)
  found.push(`the page scrolls sideways: scrollWidth ${doc.scrollWidth} > clientWidth ${doc.clientWidth}`);
const box = (r) => `${Math.round(r.left)}..${Math.round(r.right)} x ${Math.round(r.top)}..${Math.round(r.bottom)}`;
const outside = (r, c) => r.left < c.left - .5 || r.right > c.right + .5 || r.top < c.top - .5 || r.bottom > c.bottom + .5;
for (const card of document.querySelectorAll("header, section")) {
  const c = card.getBoundingClientRect();
  if (!c.width) continue;  // hidden
  if (c.right > doc.clientWidth + .5) found.push(`card ${card.id || card.tagName} ${box(c)} ends past the window`);
  for (const b of card.querySelectorAll("button")) {
    const r = b.getBoundingClientRect();
    if (!r.width && !r.height) continue;  // not shown
    const name = `button ${b.textContent} (${b.dataset.deployment || b.id}) at ${box(r)}`;
    if (outside(r, c)) found.push(`${name} outside its card ${card.querySelector("h1, h2")?.textContent} at ${box(c)}`);
    for (let a = b.parentElement; a && a !== card; a = a.parentElement) {
      const style = getComputedStyle(a);
      if (style.overflowX === "visible" && style.overflowY === "visible") continue;
      const clip = a.getBoundingClientRect();
      if (outside(r, clip)) found.push(`${name} cut off by ${a.tagName}.${a.className} at ${box(clip)}`);
    }
  }
}
return found;
"""


def _overflow_at_each_width(driver, artifacts: Path) -> list[str]:
    """OVERFLOW_JS at each of VIEWPORTS in this one page session (the device metrics are
    emulated, the phone's as a phone's), and a screenshot of each width, named in what overflows."""
    problems, shots = [], []
    for width, height, mobile in VIEWPORTS:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile})
        found = driver.execute_script(OVERFLOW_JS)
        shot = artifacts / f"{'overflow' if found else 'fits'}-{width}x{height}.png"
        driver.save_screenshot(str(shot))
        shots.append(str(shot))
        if found:
            problems.append(f"at {width} x {height} (screenshot {shot}):\n  " + "\n  ".join(found))
    driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    print(f"\ndashboard at each width: {' '.join(shots)}")
    return problems


def test_park_through_the_dashboard_changes_the_unit_and_the_page(capyhost, smollm2, tmp_path):
    chromium, chromedriver = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    path = capyhost.write_manifest("smollm2", f"name: smollm2\nengine: llama\nmodel:\n  path: {smollm2}\n")
    capyhost.cli("deploy", "model", "--file", str(path), "--activate", "--wait")
    unit = "capyctl-smollm2.service"
    assert capyhost.unit_property(unit, "ActiveState") == "active"
    # A second deployment, recorded and not started: the table has two rows.
    idle = capyhost.write_manifest("smollm2-idle", f"name: smollm2-idle\nengine: llama\nmodel:\n  path: {smollm2}\n")
    capyhost.cli("deploy", "model", "--file", str(idle))

    forward = subprocess.Popen([str(CAPYCTL), "--api-socket", str(capyhost.api_socket), "ui"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    driver = None
    artifacts = _artifacts(tmp_path)
    try:
        line = forward.stdout.readline()
        match = re.search(r"(http://127\.0\.0\.1:\d+/ui/#session=\S+)", line)
        assert match, f"capyctl ui printed {line!r}; stderr: {forward.stderr.read() if forward.poll() else ''}"
        url = match.group(1)

        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,1000",
                    "--disable-gpu", "--no-first-run", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
            options.add_argument(arg)
        driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
        driver.set_page_load_timeout(WAIT_S)
        driver.get(url)
        # The table is drawn again on every event: look elements up afresh each time.
        wait = WebDriverWait(driver, WAIT_S, ignored_exceptions=[StaleElementReferenceException])

        def shown(cell: str) -> str | None:
            return driver.execute_script(
                f'const c = document.querySelector(\'tr[data-deployment="smollm2"] td.{cell}\'); '
                'return c ? c.textContent : null;')

        def button(action: str):
            return driver.find_element(By.CSS_SELECTOR, f'button[data-action="{action}"][data-deployment="smollm2"]')

        def state_shown(driver) -> str | None:
            return shown("state")

        wait.until(lambda d: state_shown(d) == "ready")
        # The session secret left the address bar (it stays in this tab's sessionStorage only).
        assert "session=" not in driver.current_url
        assert (shown("engine"), shown("unit"), shown("revision"), shown("host")) == ("llama", unit, "1", "local")
        # Memory: the host's RAM bar shows what the deployment holds.
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, '.domain[data-domain^="ram:"] .segment'
                                                              '[data-deployment="smollm2"]'))
        # The journal of the deployment, followed live.
        wait.until(lambda d: button("logs").click() or True)
        wait.until(lambda d: d.find_element(By.ID, "journal").text.strip())
        driver.save_screenshot(str(artifacts / "ready.png"))

        wait.until(lambda d: button("park").is_enabled())
        wait.until(lambda d: button("park").click() or True)
        wait.until(lambda d: state_shown(d) == "parked")
        driver.save_screenshot(str(artifacts / "parked.png"))
        print(f"\ndashboard screenshots: {artifacts / 'ready.png'} {artifacts / 'parked.png'}")
        assert driver.find_element(By.ID, "action-error").text == ""

        # The unit really changed: llama-server parks by stopping its engine (the next launch's
        # unit waits at its gate, with no engine in it).
        assert capyhost.cli_json("status", "deployment", "smollm2")["state"] == "parked"
        assert capyhost.armed_at_gate(unit), capyhost.unit_processes(unit)
        # Wake is offered now, Park no longer.
        wait.until(lambda d: button("wake").is_enabled() and not button("park").is_enabled())

        # The wake: the page says how long it took and what it restored of the prompt cache
        # (the park saved what the slots held: at least the proof's prompt).
        wait.until(lambda d: button("wake").is_enabled())
        wait.until(lambda d: button("wake").click() or True)
        wait.until(lambda d: state_shown(d) == "ready")
        wait.until(lambda d: "cached tokens restored" in (shown("wake") or ""))
        assert driver.find_elements(By.CSS_SELECTOR, 'tr[data-deployment="smollm2-idle"]')

        # With that long note in Last wake, two rows, and the journal open, nothing on the page
        # overflows: not on a laptop, not on a phone.
        problems = _overflow_at_each_width(driver, artifacts)
        assert not problems, "the dashboard overflows\n" + "\n".join(problems)
    finally:
        if driver is not None:
            driver.quit()
        forward.terminate()
        try:
            forward.wait(10)
        except subprocess.TimeoutExpired:
            forward.kill()
