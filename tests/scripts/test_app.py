"""app.py in a real browser: the Gradio page of a tiny model, served on a free loopback port
and driven in headless Chromium (Debian's package, through Playwright and its system
executable: no browser download). The grid shown equals sample.py's for the same source,
classes, sampler, steps, guidance and seed, pixel for pixel; bad input is answered in the
page with sample.py's own one-line error. Without a browser: a published .pt through the
page's code equals its export through sample.py, the progress the page shows follows
sample.py's bars, and app.py's own errors are one line. Over HTTP on loopback (no browser): the
server refuses foreign Host and Origin headers and uploads, answers a bad seed or guidance in
one line, prunes its temporary files as it runs and removes them on SIGTERM, and prints no
share-link hint.

The browser tests skip, with the reason, where playwright or /usr/bin/chromium is missing
(.ci/run installs Chromium; `make` installs the Python packages). ``NALA_DIT_APP_SCREENSHOT=docs/app.png``
saves the page after the first generation (how docs/app.png is made)."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.utils import assert_names

# runs scripts end to end: the full tier (make test), in a pytest of its own after the rest (Makefile)
pytestmark = [pytest.mark.slow, pytest.mark.browser]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
# Debian's Chromium, headless, with nothing that reaches the network on its own.
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync"]
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
START_TIMEOUT_S = 180

pytest.importorskip("gradio", reason="app.py needs gradio: pip install -e '.[demo]' (make installs it)")
try:
    from playwright import sync_api
except ImportError:
    sync_api = None


def need_a_browser() -> None:
    """Skip, saying why, where the browser tests cannot run."""
    if sync_api is None:
        pytest.skip("the browser tests drive Chromium with playwright: pip install -e '.[test]' (make installs it)")
    if not Path(CHROMIUM).is_file():
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install -y --no-install-recommends chromium (.ci/run does "
                    f"it), or set CHROMIUM to its path")


@pytest.fixture(scope="module")
def pipeline_dir(tmp_path_factory) -> Path:
    """A tiny random digits NaLaDiT (8 px, pixel space) exported with class names."""
    import export
    from tests.scripts.test_sample import write_checkpoint

    root = tmp_path_factory.mktemp("app")
    run = write_checkpoint(root / "run")
    (root / "names.txt").write_text("\n".join(NAMES) + "\n")
    assert export.main(["checkpoint", str(run), str(root / "pipe"), "--labels-file", str(root / "names.txt")]) == 0
    return root / "pipe"


@pytest.fixture(scope="module")
def app_url(pipeline_dir, tmp_path_factory):
    """``python app.py --ckpt <pipeline>`` on a free port of 127.0.0.1, until the tests end."""
    from tests.utils import free_port

    need_a_browser()

    port = free_port()
    work = tmp_path_factory.mktemp("app-server")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(work / "hf"),
           "GRADIO_TEMP_DIR": str(work / "gradio"), "PYTHONPATH": str(ROOT)}
    log = open(work / "app.log", "w")
    proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--ckpt", str(pipeline_dir), "--port", str(port),
                             "--threads", "1"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"app.py exited with {proc.returncode}:\n{(work / 'app.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"app.py did not answer on {url} within {START_TIMEOUT_S} s:\n"
                            f"{(work / 'app.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def browser():
    need_a_browser()
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, app_url):
    context = browser.new_context(viewport={"width": 1180, "height": 900})
    page = context.new_page()
    page.goto(app_url)
    page.wait_for_selector("#generate")
    yield page
    context.close()


def pick(page, elem_id: str, typed: str, option: str | None, clear: bool = False) -> None:
    """Type into a dropdown and choose the one option left (``option``: its label), or,
    with ``option`` None, enter what was typed as a value of one's own."""
    expect = sync_api.expect
    box = page.locator(f"#{elem_id}")
    field = box.locator("input[role=combobox]")
    if clear:
        box.locator("[title=Clear]").click()
    field.click()
    field.fill("")
    field.press_sequentially(typed)
    if option is None:
        field.press("Enter")
    else:
        options = page.locator(f"#{field.get_attribute('aria-controls')} [role=option]")
        expect(options).to_have_count(1)
        expect(options).to_have_attribute("aria-label", option)
        options.click()
    field.press("Escape")


def set_number(page, elem_id: str, value) -> None:
    field = page.locator(f"#{elem_id} input").first
    field.fill(str(value))
    field.press("Tab")


def fetched(page, locator) -> np.ndarray:
    """The pixels of an <img> as the server sent them."""
    return np.asarray(Image.open(io.BytesIO(page.request.get(locator.get_attribute("src")).body())))


def status(page) -> str:
    return page.locator("#status-line").inner_text().strip()


def sample_cli(tmp_path, *args) -> tuple[int, str]:
    """sample.py's main on ``args``: (exit status, its last stderr line)."""
    import contextlib

    import sample

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = sample.main([str(a) for a in args])
    lines = [line for line in err.getvalue().splitlines() if line.strip()]
    return code, lines[-1] if lines else ""


def test_page_samples_by_class_name_and_shows_sample_pys_images(page, pipeline_dir, tmp_path):
    expect = sync_api.expect
    started = time.monotonic()
    pick(page, "classes", "sev", "seven (7)", clear=True)
    pick(page, "classes", "thr", "three (3)")
    assert page.locator("#classes .token").all_inner_texts() == ["seven (7)", "three (3)"]
    set_number(page, "per-label", 2)
    pick(page, "sampler", "ddi", "ddim")
    expect(page.locator("#steps input")).to_have_value("50")   # the sampler's own default
    set_number(page, "steps", 3)
    set_number(page, "guidance", 1.5)
    set_number(page, "seed", 4)
    page.locator("#generate").click()
    expect(page.locator("#status-line")).to_have_text("4 images, seed 4: the same as the command below",
                                                      timeout=120_000)
    shown = fetched(page, page.locator("#grid img"))
    images = page.locator("#images img")
    expect(images).to_have_count(4)
    assert page.locator("#images").get_by_text("0: seven").count() == 1
    command = page.locator("#command .cm-content").inner_text().strip()
    browser_s = time.monotonic() - started

    flags = ["--labels", "7,3", "--per-label", 2, "--sampler", "ddim", "--steps", 3, "--cfg-scale", 1.5, "--seed", 4]
    assert command == (f"python sample.py --ckpt {pipeline_dir} --labels 7,3 --per-label 2 --sampler ddim --steps 3 "
                       f"--cfg-scale 1.5 --seed 4 --grid grid.png --out-dir samples/")
    code, _ = sample_cli(tmp_path, "--ckpt", pipeline_dir, *flags, "--grid", tmp_path / "grid.png",
                         "--out-dir", tmp_path / "samples")
    assert code == 0
    expected = np.asarray(Image.open(tmp_path / "grid.png"))
    assert shown.shape == expected.shape == (2 * 10 + 2, 2 * 10 + 2)   # a row per class, 8 px + 2 px padding
    np.testing.assert_array_equal(shown, expected)
    for img, png in zip(images.all(), sorted((tmp_path / "samples").glob("*.png"))):
        np.testing.assert_array_equal(fetched(page, img), np.asarray(Image.open(png)))
    # every file offered for download is a PNG
    # every image is offered as its PNG, under sample.py's file names; a click downloads it
    links = page.locator("#files a[download]")
    pngs = sorted((tmp_path / "samples").glob("*.png"))
    assert [a.get_attribute("download") for a in links.all()] == ["grid.png"] + [p.name for p in pngs]
    page.wait_for_load_state("networkidle")   # the page's last fetches done: the links are the final ones
    with page.expect_download(timeout=60_000) as download:   # the other waits' scale: CI runs this beside other tests
        links.nth(4).click()
    saved = tmp_path / "downloaded.png"
    download.value.save_as(saved)
    assert saved.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    np.testing.assert_array_equal(np.asarray(Image.open(saved)), np.asarray(Image.open(pngs[3])))
    if target := os.environ.get("NALA_DIT_APP_SCREENSHOT"):   # docs/app.png: the page, in 64 colours
        shot = Image.open(io.BytesIO(page.screenshot(full_page=True)))
        shot.convert("RGB").quantize(64).save(ROOT / target, optimize=True)
    print(f"browser: picked, generated and read back in {browser_s:.1f} s")


def test_bad_input_is_one_line_in_the_page_with_sample_pys_words(page, pipeline_dir, tmp_path):
    """An unknown class, a size the token grid cannot take, steps 0: each answered in the page
    by one line, sample.py's own for the same flags (the page's defaults: 4 per class, ddpm)."""
    expect = sync_api.expect
    seen = []

    def answered(flags: list, words: str) -> None:
        page.locator("#generate").click()
        expect(page.locator("#status-line")).to_contain_text(words, timeout=60_000)
        line = status(page)
        code, cli_line = sample_cli(tmp_path, "--ckpt", pipeline_dir, *flags, "--per-label", 4,
                                    "--grid", tmp_path / "g.png")
        assert code == 1 and line == cli_line, (line, cli_line)
        assert line.startswith("error: ") and "\n" not in line
        assert page.locator("#status-line.error").count() == 1 and page.locator("#grid img").count() == 0
        seen.append(line)

    pick(page, "classes", "sevn", None, clear=True)    # typed, not one of the names
    answered(["--labels", "sevn"], "'sevn' (did you mean seven?)")
    pick(page, "classes", "sev", "seven (7)", clear=True)
    pick(page, "size", "9", None)                      # patch 2: even sides only
    answered(["--labels", "7", "--image-size", 9],
             "image size 9 is not a multiple of VAE factor 1 × patch 2 = 2")
    pick(page, "size", "8", "8 (trained)")
    set_number(page, "steps", 0)
    answered(["--labels", "7", "--steps", 0], "--steps must be >= 1 for ddpm, got 0")
    assert len(set(seen)) == 3 and not (tmp_path / "g.png").exists()


def test_a_progress_bar_follows_the_sampler_steps(page):
    """32 images in one batch, ddpm's 40 steps (the page's): the page shows the step count as it goes."""
    import re

    expect = sync_api.expect
    pick(page, "classes", "sev", "seven (7)", clear=True)
    pick(page, "classes", "thr", "three (3)")
    set_number(page, "per-label", 16)
    set_number(page, "guidance", 1)   # one forward pass per step, not guidance's two
    page.locator("#generate").click()
    expect(page.locator("#status")).to_contain_text(re.compile(r"images 1-32 of 32: step \d+/40"), timeout=60_000)
    expect(page.locator("#status-line")).to_have_text("32 images, seed 0: the same as the command below",
                                                      timeout=300_000)


# ----------------------------------------------------------------- without a browser
def test_progress_follows_sample_pys_bars():
    """``watch_progress`` sees the bar over images and each batch's step bar, off a terminal too."""

    from nala_dit.progress import watch_progress
    from nala_dit.diffusion.generate import SampleSettings
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.sample_files import sample_images
    from nala_dit.pipelines.sources import Source
    from nala_dit.training.checkpoint import build_objective

    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10).eval()
    source = Source(model, build_objective(dict(model.config), {}))
    seen = []
    with watch_progress(lambda desc, n, total: seen.append((desc, n, total))):
        sample_images(source, [1, 2, 3], 0, SampleSettings("ddim", 2), batch_size=2, progress=True)
    steps = [("steps", 0, 2), ("steps", 1, 2), ("steps", 2, 2)]
    assert seen == [("sample", 0, 3), *steps, ("sample", 2, 3), *steps, ("sample", 3, 3)]


def test_a_published_pt_through_the_page_equals_its_export_through_sample_py(tmp_path):
    """The page's own request code (no browser) on an "official" .pt equals sample.py on
    ``export.py official`` of it, and the page shows those two commands."""
    import torch
    from diffusers import AutoencoderKL

    import app
    import export
    import sample
    from nala_dit.models.dit import create_model

    torch.manual_seed(0)
    vae = tmp_path / "vae"
    AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, norm_num_groups=8,
                  latent_channels=4, sample_size=64).save_pretrained(vae)
    torch.save(create_model("DiT-T/4", input_size=8, num_classes=1000).state_dict(), tmp_path / "DiT.pt")
    args = app.build_parser().parse_args(["--ckpt", str(tmp_path / "DiT.pt"), "--model", "DiT-T/4", "--image-size",
                                          "64", "--vae", str(vae)])
    demo = app.Demo(args, app.load(args))
    assert demo.size_choices() == [("32", "32"), ("64 (trained)", "64"), ("96", "96"), ("128", "128")]  # × 32 px
    status, grid, gallery, files, command = demo.generate(["207", "3"], 1, "ddim", 2, 1.5, 7, "64")
    assert "2 images, seed 7" in status and len(gallery) == 2 and len(files) == 3
    folder = f"exported/{(tmp_path / 'DiT').name}"
    assert command.splitlines() == [
        f"python export.py official {tmp_path / 'DiT.pt'} {folder} --model DiT-T/4 --image-size 64 --num-classes 1000 "
        f"--vae {vae}",
        f"python sample.py --ckpt {folder} --vae {vae} --labels 207,3 --per-label 1 --sampler ddim --steps 2 "
        f"--cfg-scale 1.5 --seed 7 --grid grid.png --out-dir samples/"]
    out = tmp_path / "exported" / "DiT"
    assert export.main(["official", str(tmp_path / "DiT.pt"), str(out), "--model", "DiT-T/4", "--image-size", "64",
                        "--vae", str(vae)]) == 0
    assert sample.main(["--ckpt", str(out), "--vae", str(vae), "--labels", "207,3", "--sampler", "ddim", "--steps",
                        "2", "--cfg-scale", "1.5", "--seed", "7", "--grid", str(tmp_path / "grid.png")]) == 0
    np.testing.assert_array_equal(np.asarray(Image.open(grid)), np.asarray(Image.open(tmp_path / "grid.png")))
    assert np.asarray(Image.open(grid)).shape == (64 + 4, 2 * 64 + 6, 3)


def test_app_errors_are_one_line(tmp_path, capsys):
    import app

    assert app.main(["--ckpt", str(tmp_path / "nothing")]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert_names(lines[0], "no checkpoint or pipeline folder", str(tmp_path / "nothing"))
    (tmp_path / "DiT.pt").write_bytes(b"")
    assert app.main(["--ckpt", str(tmp_path / "DiT.pt")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    assert_names(err, f"--ckpt {tmp_path / 'DiT.pt'} is a file", "needs --model", "e.g. DiT-XL/2", "export.py official")


# ----------------------------------------------------------------- over HTTP, no browser
@contextlib.contextmanager
def served(pipeline_dir, work: Path, *flags):
    """``app.py --ckpt <pipeline>`` on a free loopback port, its temporary files under
    ``work/tmp`` (TMPDIR; GRADIO_TEMP_DIR unset, as for a user): (url, process, log path)."""
    from tests.utils import free_port

    port = free_port()
    (work / "tmp").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_TEMP_DIR"}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_HOME=str(work / "hf"), TMPDIR=str(work / "tmp"),
               PYTHONPATH=str(ROOT))
    log_path = work / "app.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(ROOT / "app.py"), "--ckpt", str(pipeline_dir), "--port", str(port),
                                 "--threads", "1", *flags], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            while http(f"{url}/", headers={"Host": f"127.0.0.1:{port}"})[0] != 200:
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"app.py did not start (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
                time.sleep(0.5)
            yield url, proc, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def http(url: str, data: bytes | None = None, headers: dict | None = None) -> tuple[int, str]:
    """(status, body) of one request; an HTTP error status is returned, not raised."""
    request = urllib.request.Request(url, data=data, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode(errors="replace")
    except OSError as err:   # not listening yet
        return 0, str(err)


def ask(url: str, classes, per_label=1, sampler="ddim", steps=2, guidance=1, seed=0, size="8") -> list:
    """One press of Generate through Gradio's HTTP API (``/gradio_api/call/generate``): the
    five outputs (status, grid, gallery, files, command)."""
    import json

    body = json.dumps({"data": [classes, per_label, sampler, steps, guidance, seed, size]}).encode()
    status, text = http(f"{url}/gradio_api/call/generate", body, {"Content-Type": "application/json"})
    assert status == 200, text
    _, events = http(f"{url}/gradio_api/call/generate/{json.loads(text)['event_id']}")
    (done,) = [line for line in events.splitlines() if line.startswith("data: ") and "status-line" in line]
    return json.loads(done.removeprefix("data: "))


def status_text(outputs: list) -> str:
    import html

    return html.unescape(re.sub(r"<.*?>", "", outputs[0]))


def test_the_server_refuses_foreign_hosts_origins_and_uploads(pipeline_dir, tmp_path):
    """DNS rebinding (a foreign Host), another site's page posting (a foreign Origin) and
    uploads (the page has none) get 403; the page's own requests pass. A bad seed, guidance
    or image size is one line in the page."""
    with served(pipeline_dir, tmp_path) as (url, proc, log):
        port = url.rsplit(":", 1)[1]
        assert http(f"{url}/")[0] == 200 and http(f"http://localhost:{port}/")[0] == 200
        status, text = http(f"{url}/", headers={"Host": f"attacker.example:{port}"})
        assert status == 403 and "attacker.example" in text and "--host" in text
        status, text = http(f"{url}/gradio_api/info", headers={"Host": "127.0.0.1.attacker.example"})
        assert status == 403
        files_before = sorted(p for p in (tmp_path / "tmp").rglob("*") if p.is_file())
        upload = b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"x.bin\"\r\n\r\n" + \
            b"\0" * 2_000_000 + b"\r\n--b--\r\n"
        status, text = http(f"{url}/gradio_api/upload", upload, {"Content-Type": "multipart/form-data; boundary=b"})
        assert status == 403 and "no uploads" in text
        assert sorted(p for p in (tmp_path / "tmp").rglob("*") if p.is_file()) == files_before   # nothing stored
        body = b'{"data": [["1"], 1, "ddim", 2, 1, 0, "8"]}'
        status, text = http(f"{url}/gradio_api/call/generate", body,
                            {"Content-Type": "application/json", "Origin": "http://attacker.example"})
        assert status == 403 and "attacker.example" in text
        status, _ = http(f"{url}/gradio_api/call/generate", body,
                         {"Content-Type": "application/json", "Origin": f"http://localhost:{port}"})
        assert status == 200

        assert "1 images, seed 3" in status_text(ask(url, ["1"], seed=3))
        for kwargs, words in ((dict(seed=-1), "error: argument --seed: must be a whole number >= 0, got -1"),
                              (dict(steps=1001), "error: 1001 steps asked for; this page runs at most 1000 per request "
                                                 "(app.py --max-steps)"),
                              (dict(guidance="abc"), "error: guidance 'abc' is not a number: type e.g. 1.5")):
            line = status_text(ask(url, ["1"], **kwargs))
            assert line.startswith(words) and "\n" not in line, line
        assert proc.poll() is None


def test_temporary_files_are_pruned_and_removed_on_sigterm(pipeline_dir, tmp_path):
    """Every request writes images (and Gradio copies them): the server keeps the newest
    request's folder and Gradio's copies younger than --keep-minutes, deletes the rest as it
    runs, and removes its whole folder on SIGTERM. Its log names the URL and no share link."""
    import signal

    def files() -> list[Path]:
        return [p for p in (tmp_path / "tmp").glob("nala_dit_app-*/**/*") if p.is_file()]

    with served(pipeline_dir, tmp_path, "--keep-minutes", "0.05") as (url, proc, log):   # 3 s
        for seed in range(6):
            assert "4 images" in status_text(ask(url, ["1", "2"], per_label=2, seed=seed))
        written = files()
        # at most the last two requests' folders (5 files each) and Gradio's copies of the images shown
        assert len([p for p in written if "requests" in p.parts]) <= 10, written
        time.sleep(8)   # past --keep-minutes, and Gradio's cleaning every 3 s
        assert len([p for p in files() if "requests" not in p.parts]) == 0, files()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert list((tmp_path / "tmp").glob("nala_dit_app-*")) == []
        text = log.read_text()
        assert "app: stopped (SIGTERM); its temporary files are removed" in text and "Keyboard" not in text, text
        assert f"open {url}/ (this machine only, no share link; Ctrl-C stops it)" in text
        assert "share=True" not in text and "public link" not in text


def test_the_page_defaults_to_the_demos_guidance(pipeline_dir):
    """The page's guidance starts at the demo's (demo.py CFG_SCALE, 2); 1 for a model
    without a null class, which cannot be guided."""
    import app
    import demo
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.sources import Source
    from nala_dit.training.checkpoint import build_objective

    def guidance_shown(page) -> float:
        (field,) = [b for b in page.blocks.values() if getattr(b, "elem_id", None) == "guidance"]
        return field.value

    args = app.build_parser().parse_args(["--ckpt", str(pipeline_dir)])
    page = app.Demo(args, app.load(args)).page()
    assert guidance_shown(page) == app.GUIDANCE == demo.CFG_SCALE == 2.0
    model = create_model("NaLaDiT-T/2", input_size=8, in_channels=1, num_classes=10, class_dropout_prob=0.0).eval()
    assert model.null_label is None
    unguided = app.Demo(args, Source(model, build_objective(dict(model.config), {}), id2label=dict(enumerate(NAMES))))
    assert guidance_shown(unguided.page()) == 1.0


def test_the_page_starts_at_the_demos_steps(pipeline_dir):
    """ddpm starts at the demo's 40 steps (its own default, 250, took 6x as long), ode-heun at the
    demo's 16; a sampler the demo does not use keeps its own default."""
    import app
    import demo
    from nala_dit.cli.options import DEFAULT_STEPS

    demo_steps = {sampler: steps for _, _, sampler, steps in demo.MODELS}
    assert {s: app.Demo.default_steps(s) for s in demo_steps} == demo_steps == {"ddpm": 40, "ode-heun": 16}
    assert app.Demo.default_steps("ddim") == DEFAULT_STEPS["ddim"]
    args = app.build_parser().parse_args(["--ckpt", str(pipeline_dir)])
    page = app.Demo(args, app.load(args)).page()
    (steps,) = [b for b in page.blocks.values() if getattr(b, "elem_id", None) == "steps"]
    assert steps.value == 40   # the pipeline's DiT samples with ddpm


def test_the_errors_docs_app_quotes_for_the_demos_model_are_its_own():
    """docs/app.md's examples of a bad class and bad steps are what the demo's digits model
    (classes 0-9, no names) answers."""
    from nala_dit.cli.options import check_steps
    from nala_dit.pipelines.sources import resolve_labels

    page = " ".join((ROOT / "docs" / "app.md").read_text().split())
    digits = {i: str(i) for i in range(10)}
    for typed in ("11", "seven"):
        with pytest.raises(ValueError) as err:
            resolve_labels([typed], digits, 10)
        assert f"`error: {err.value}`" in page, err.value
    with pytest.raises(ValueError) as err:
        check_steps("ddpm", 0)
    assert f"`error: {err.value}`" in page
    assert "sevn" not in page


def test_a_failure_while_sampling_is_one_line_in_the_page(pipeline_dir, monkeypatch):
    """torch's RuntimeError (e.g. memory refused past the check, for a 2000 × 2000 request) is
    the page's one status line naming what to change, not Gradio's bare 'Error'."""
    import app
    import sample

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory:\n you tried to allocate 64000000000 bytes.")

    monkeypatch.setattr(sample, "write_samples", out_of_memory)
    args = app.build_parser().parse_args(["--ckpt", str(pipeline_dir), "--max-work", "10000000"])
    status, grid, gallery, files, command = app.Demo(args, app.load(args)).generate(["1"], 1, "ddim", 2, 1, 0,
                                                                                    "2000")
    line = re.sub(r"<.*?>", "", status)
    assert line == ("error: sampling failed: DefaultCPUAllocator: not enough memory: you tried to allocate "
                    "64000000000 bytes.; ask for fewer images, a smaller image size or a smaller app.py --batch-size")
    assert grid is None and gallery == [] and "--image-size 2000" in command


def test_a_request_past_the_work_cap_is_one_line_before_sampling(pipeline_dir, monkeypatch):
    """2,048 px of the 8-px model at 3 guided ddim steps (it held the page's only worker for 769 s):
    1 image x 1,048,576 tokens x 3 steps x 2 = 6,291,456 token evaluations, refused in the page's
    one status line before anything is sampled; the demo's largest request passes."""
    import app
    import sample

    monkeypatch.setattr(sample, "write_samples", lambda *a, **k: pytest.fail("sampled past the cap"))
    args = app.build_parser().parse_args(["--ckpt", str(pipeline_dir)])
    page = app.Demo(args, app.load(args))
    status, grid, gallery, files, command = page.generate(["1"], 1, "ddim", 3, 2, 0, "2048")
    line = re.sub(r"<.*?>", "", status)
    assert line == ("error: this request is 6,291,456 token evaluations (1 images x 1,048,576 tokens x 3 steps x 2 "
                    "(guidance)); this page runs at most 1,048,576 per request (app.py --max-work): choose a smaller "
                    "size, fewer images or steps, or run the command below")
    assert grid is None and "--image-size 2048" in command
    largest = app.parse_sample_args(page.argv([str(i) for i in range(8)], 8, "ddpm", 40, 2, 0, "16", "g.png", "o"))
    assert page.request_work(largest, 64) == (64 * 64 * 40 * 2, "64 images x 64 tokens x 40 steps x 2 (guidance)")
    assert page.request_work(largest, 64)[0] <= app.MAX_WORK


def test_the_page_offers_meanflow_for_meanflow_models_only(pipeline_dir):
    """A MeanFlow model's page starts at the meanflow sampler and 1 step; a plain SiT's lists
    no meanflow (it would be refused)."""
    import app
    from nala_dit.models.dit import create_model
    from nala_dit.pipelines.sources import Source
    from nala_dit.training.checkpoint import build_objective

    args = app.build_parser().parse_args(["--ckpt", str(pipeline_dir)])
    pages = {}
    for mean_flow in (True, False):
        model = create_model("NaLaSiT-T/2", input_size=8, in_channels=1, num_classes=10, mean_flow=mean_flow).eval()
        pages[mean_flow] = app.Demo(args, Source(model, build_objective(dict(model.config), {}),
                                                 id2label=dict(enumerate(NAMES))))
    assert pages[True].default_sampler == "meanflow" and "meanflow" in pages[True].samplers
    assert app.Demo.default_steps("meanflow") == 1
    assert pages[False].default_sampler == "ode-heun" and "meanflow" not in pages[False].samplers
