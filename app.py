"""A web page on this machine to sample a model by class name (Gradio: ``pip install -e '.[demo]'``;
``make`` installs it).

    python app.py --ckpt runs/demo/NaLaDiT                 # then open http://127.0.0.1:7860
    python app.py --ckpt exported/nala-dit-s2 --port 8000 --labels-file imagenet_classes.txt
The published DiT / SiT weights, as ``export.py official`` reads them:
    python app.py --ckpt DiT-XL-2-256x256.pt --model DiT-XL/2 --image-size 256 --vae sd-vae-ft-ema \\
        --labels-file imagenet_classes.txt

``--ckpt`` takes what ``sample.py`` takes (a run folder: its latest checkpoint; a checkpoint
folder; an exported pipeline folder) and a published ``.pt``. The page: the classes by name
(the model's ``id2label`` or ``--labels-file``; type to search), images per class, sampler
and steps (the model's own sampler, as ``sample.py``'s, at the demo's steps), guidance, seed and image size (the
trained size and others its token grid takes; any other can be typed); a progress bar while
it samples; the grid, every image (open one for its download button) and the PNG files; and
the ``sample.py`` line that makes the same images. Every request is turned into that
``sample.py`` command line and run through ``sample.py``'s own code (its parser,
``checked_settings`` and ``write_samples``), so the pixels are the command's and a bad
request gets the command's one-line error in the page. One generation runs at a time; the
others wait in a queue. It listens on 127.0.0.1 (this machine only) unless ``--host`` says
otherwise, answers only requests addressed to the names it listens under (``RequestGuard``:
no DNS rebinding, no other site's page posting to it) and takes no uploads; what it writes
lives in one temporary folder, pruned as it runs (``--keep-minutes``) and removed at exit,
Ctrl-C or SIGTERM. docs/app.md.
"""

from __future__ import annotations

import argparse
import html
import ipaddress
import itertools
import os
import shlex
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

from nala_dit.cli.requirements import require_installed

require_installed()  # a python without torch (not the .venv one): one line naming .venv, not a traceback

from nala_dit.cli.parse import THREADS_HELP, ArgumentParser, passive_wait_policy, run_main, set_threads  # noqa: E402

passive_wait_policy()  # OMP_WAIT_POLICY=PASSIVE before torch loads, unless set (docs/performance.md, Threads)
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # nothing leaves the machine

HOST, PORT = "127.0.0.1", 7860
MAX_IMAGES = 64        # per request: the images of one press of the button
MAX_STEPS = 1000       # per request: 4x SiT's 250 SDE steps; sample.py allows 10,000 (an ODE at 10^8 held the worker)
# per request: images x tokens per image x model evaluations (steps, twice with guidance), what its time grows
# with; 2,048 px of the 8-px demo model at 3 guided steps (6.3 M) held the only worker for 769 s. The demo's 64
# images x 40 guided steps x 16 tokens are 81,920; 64 images at twice its size 327,680.
MAX_WORK = 2 ** 20
# the page's default sampler steps where the demo sets its own (demo.py MODELS: ddpm 40, ode-heun 16); ddpm's own 250
# ran one press 6x longer than the demo's grids. Other samplers start at their own default (DEFAULT_STEPS).
STEPS = {"ddpm": 40, "ode-heun": 16}
GUIDANCE = 2.0         # the page's default guidance: the demo's (demo.py CFG_SCALE, docs/demo.md); 1 without a null class
KEEP_MINUTES = 30      # a request's images stay on disk this long (the page shows and offers them), then are deleted
SIZE_RATIOS = (0.5, 0.75, 1.5, 2)   # other sizes offered, as fractions of the trained side
ERRORS = (ValueError, FileNotFoundError, OSError, KeyError)   # sample.py's one-line errors


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__)
    p.add_argument("--ckpt", required=True, help="run folder (latest checkpoint), checkpoint folder, pipeline "
                   "folder, or a published DiT/SiT .pt (with --model)")
    p.add_argument("--weights", choices=["ema", "model"], default="ema", help="checkpoint weights")
    p.add_argument("--vae", help="VAE folder or hub id (default: the one the model names; .pt: "
                   "stabilityai/sd-vae-ft-ema)")
    p.add_argument("--labels-file", help="class names: .json (list or {id: name}) or one name per line")
    official = p.add_argument_group("a published .pt (as export.py official)")
    official.add_argument("--model", help="its softmax preset, e.g. DiT-XL/2 or SiT-XL/2")
    official.add_argument("--image-size", type=int, default=256, help="its image size in pixels")
    official.add_argument("--num-classes", type=int, default=1000)
    run = p.add_argument_group("sampling and serving")
    run.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="transformer precision")
    run.add_argument("--batch-size", type=int, default=32, help="samples per forward pass (as sample.py's)")
    run.add_argument("--max-images", type=int, default=MAX_IMAGES, help="most images one request may ask for")
    run.add_argument("--max-work", type=int, default=MAX_WORK, metavar="TOKEN_EVALUATIONS",
                     help="most work one request may ask for: images x tokens per image x model evaluations (steps, "
                          "x2 with guidance); bounds a request's time (default %(default)s)")
    run.add_argument("--max-steps", type=int, default=MAX_STEPS, help="most sampler steps one request may ask for "
                     "(sample.py's own bound is larger: the page's one worker stays free for other requests)")
    run.add_argument("--host", default=HOST, help="address to listen on (default: this machine only)")
    run.add_argument("--port", type=int, default=PORT, help="port (0: any free one)")
    run.add_argument("--threads", type=int, help=THREADS_HELP)
    run.add_argument("--keep-minutes", type=float, default=KEEP_MINUTES, help="how long a request's images stay on "
                     "disk for the page to show and download; older ones are deleted as it runs, all at exit")
    return p


def load(args):
    """The ``Source`` of ``--ckpt`` (``sources.load_source``, or ``load_official_source`` for a .pt)."""
    from nala_dit.cli.parse import default_device
    from nala_dit.pipelines.sources import load_official_source, load_source, read_labels_file

    device = default_device()   # as sample.py
    path = Path(args.ckpt)
    if path.is_file() or (not path.exists() and path.suffix in (".pt", ".pth")):
        if not args.model:
            raise ValueError(f"--ckpt {path} is a file: a published DiT/SiT .pt needs --model (e.g. DiT-XL/2), as "
                             f"export.py official")
        source = load_official_source(path, args.model, args.image_size, args.num_classes, args.vae, device)
    else:
        source = load_source(path, args.weights, args.vae, device)
    if args.labels_file:
        names = read_labels_file(args.labels_file)
        if len(names) != source.num_classes:
            raise ValueError(f"--labels-file {args.labels_file} names {len(names)} classes, the model has "
                             f"{source.num_classes}")
        source.id2label = names
    return source


def status_line(text: str, error: bool = False) -> str:
    kind = "error" if error else "done"
    return f'<div id="status-line" class="status {kind}">{html.escape(text)}</div>'


class Demo:
    """One loaded model and the page that samples it."""

    def __init__(self, args, source, work: tempfile.TemporaryDirectory | None = None):
        from nala_dit.diffusion.generate import default_sampler
        from nala_dit.cli.options import DIFFUSION_SAMPLERS, TRANSPORT_SAMPLERS
        from nala_dit.models.grid import vae_factor

        self.args, self.source = args, source
        self.official = Path(args.ckpt).is_file()
        self.samplers = [name for name in (DIFFUSION_SAMPLERS if source.model.config.objective == "diffusion"
                                           else TRANSPORT_SAMPLERS)
                         if name != "meanflow" or getattr(source.objective, "mean_flow", False)]   # MeanFlow models
        self.default_sampler = default_sampler(source.objective)
        self.factor = vae_factor(source.vae)
        self.trained = source.model.config.input_size * self.factor
        # this process's outputs (and, from main, Gradio's copies of them), removed at exit
        self.work = work or tempfile.TemporaryDirectory(prefix="nala_dit_app-")
        self.requests = itertools.count()

    # ------------------------------------------------------------- what the page offers
    def class_choices(self) -> list[tuple[str, str]]:
        return [(name if name == str(i) else f"{name} ({i})", str(i)) for i, name in sorted(self.source.id2label.items())]

    def size_choices(self) -> list[tuple[str, str]]:
        step = self.factor * self.source.model.config.patch_size
        sides = {self.trained} | {round(self.trained * r / step) * step for r in SIZE_RATIOS}
        return [(f"{s} (trained)" if s == self.trained else str(s), str(s)) for s in sorted(sides) if s >= step]

    @staticmethod
    def default_steps(sampler: str) -> int:
        from nala_dit.cli.options import DEFAULT_STEPS

        return STEPS.get(sampler, DEFAULT_STEPS[sampler])

    def describe(self) -> str:
        info, model = self.source.info, self.source.model
        params = sum(p.numel() for p in model.parameters())
        where = info.get("pipeline") or info.get("checkpoint") or self.args.ckpt
        step = f", step {info['step']:,}" if info.get("step") is not None else ""
        space = f"latent {model.config.input_size} px of a VAE" if self.source.vae is not None else "pixel space"
        guidance = "" if self.has_null_class() else " · no null class: guidance must stay 1"
        return (f"**{info.get('model') or 'model'}** · {params:,} parameters · {model.config.objective} · "
                f"{self.source.num_classes} classes · {self.trained} px ({space}){guidance}  \n"
                f"from `{where}`{step}, {info.get('weights')} weights")

    def has_null_class(self) -> bool:
        return self.source.model.null_label is not None

    def default_guidance(self) -> float:
        """The demo's guidance (``GUIDANCE``) where the model was trained with a null class; else 1."""
        return GUIDANCE if self.has_null_class() else 1.0

    # ------------------------------------------------------------- one request
    def argv(self, classes, per_label, sampler, steps, guidance, seed, size, grid, out_dir) -> list[str]:
        """The ``sample.py`` arguments of a request."""
        argv = ["--ckpt", str(self.args.ckpt)]
        if self.args.weights != "ema":
            argv += ["--weights", self.args.weights]
        if self.args.vae:
            argv += ["--vae", self.args.vae]
        argv += ["--labels", ",".join(str(c).strip() for c in (classes or []))]
        argv += ["--per-label", str(_number(per_label, 1))]
        if sampler:
            argv += ["--sampler", str(sampler)]
        if steps is not None:
            argv += ["--steps", str(_number(steps, None))]
        if guidance is not None:
            try:
                argv += ["--cfg-scale", f"{float(guidance):g}"]
            except ValueError:
                raise ValueError(f"guidance {guidance!r} is not a number: type e.g. 1.5 (1 = none; sample.py "
                                 f"--cfg-scale)") from None
        argv += ["--seed", str(_number(seed, 0))]
        if size not in (None, "", str(self.trained)):
            argv += ["--image-size", str(size).strip()]
        if self.args.precision != "fp32":
            argv += ["--precision", self.args.precision]
        if self.args.batch_size != 32:
            argv += ["--batch-size", str(self.args.batch_size)]
        return argv + ["--grid", str(grid), "--out-dir", str(out_dir)]

    def command(self, argv: list[str]) -> str:
        """The command line a user runs for the same images (outputs in the current folder)."""
        shown = list(argv)
        shown[shown.index("--grid") + 1] = "grid.png"
        shown[shown.index("--out-dir") + 1] = "samples/"
        if not self.official:
            return "python sample.py " + shlex.join(shown)
        folder = f"exported/{Path(self.args.ckpt).stem}"
        export = ["official", self.args.ckpt, folder, "--model", self.args.model, "--image-size",
                  str(self.args.image_size), "--num-classes", str(self.args.num_classes)]
        export += ["--vae", self.args.vae] if self.args.vae else []
        shown[shown.index("--ckpt") + 1] = folder
        return f"python export.py {shlex.join(export)}\npython sample.py {shlex.join(shown)}"

    def generate(self, classes, per_label, sampler, steps, guidance, seed, size, progress=None):
        """One press of the button: (status, grid, gallery, files, command)."""
        import sample
        from nala_dit.progress import watch_progress

        request = next(self.requests)
        self.prune(request)
        out = Path(self.work.name) / "requests" / f"{request:05d}"
        grid, out_dir = out / "grid.png", out / "images"
        command = ""
        try:
            argv = self.argv(classes, per_label, sampler, steps, guidance, seed, size, grid, out_dir)
            command = self.command(argv)
            args = parse_sample_args(argv)
            wanted = len([c for c in args.labels.split(",") if c.strip()]) * args.per_label
            if wanted > self.args.max_images:
                raise ValueError(f"{wanted} images asked for; this page makes at most {self.args.max_images} per "
                                 f"request (app.py --max-images): choose fewer classes or images per class")
            settings = sample.checked_settings(args)
            if args.steps is not None and args.steps > self.args.max_steps:
                raise ValueError(f"{args.steps} steps asked for; this page runs at most {self.args.max_steps} per "
                                 f"request (app.py --max-steps): choose fewer steps, or run the command below")
            work, terms = self.request_work(args, wanted)
            if work > self.args.max_work:
                raise ValueError(f"this request is {work:,} token evaluations ({terms}); this page runs at most "
                                 f"{self.args.max_work:,} per request (app.py --max-work): choose a smaller size, "
                                 f"fewer images or steps, or run the command below")
            out.mkdir(parents=True)
            with watch_progress(_ProgressBar(progress, max(wanted, 1), args.batch_size)):
                labels, pngs = sample.write_samples(args, self.source, settings)
        except ERRORS as err:
            return status_line(f"error: {one_line(err)}", error=True), None, [], None, command
        except RuntimeError as err:   # torch's: memory refused past the check, a failed kernel
            return status_line(f"error: sampling failed: {one_line(err)}; ask for fewer images, a smaller image size "
                               f"or a smaller app.py --batch-size", error=True), None, [], None, command
        names = self.source.id2label
        gallery = [(str(p), f"{i}: {names.get(y, y)}") for i, (p, y) in enumerate(zip(pngs, labels))]
        done = f"{len(labels)} images, seed {args.seed}: the same as the command below"
        return status_line(done), str(grid), gallery, [str(grid)] + [str(p) for p in pngs], command

    def request_work(self, args, images: int) -> tuple[int, str]:
        """(token evaluations, their terms) of a request, before anything is allocated: images x
        tokens per image (at the requested size) x model evaluations (the sampler's steps, twice
        with guidance), what a request's time grows with."""
        from nala_dit.cli.options import DEFAULT_STEPS
        from nala_dit.models.grid import latent_for

        config = self.source.model.config
        h, w = latent_for(self.source.model, self.source.vae, args.image_size) or (config.input_size,) * 2
        tokens = (h // config.patch_size) * (w // config.patch_size)
        steps = args.steps if args.steps is not None else DEFAULT_STEPS[args.sampler or self.default_sampler]
        guided = args.cfg_scale != 1
        terms = f"{images} images x {tokens:,} tokens x {steps} steps{' x 2 (guidance)' if guided else ''}"
        return images * tokens * steps * (2 if guided else 1), terms

    def prune(self, request: int) -> None:
        """Remove this process's request folders older than the one before ``request``:
        Gradio has copied what the page shows into its cache by then (pruned by age,
        ``delete_cache``)."""
        for old in (Path(self.work.name) / "requests").glob("[0-9]*"):
            if old.name.isdigit() and int(old.name) < request - 1:
                shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------- the page
    def page(self):
        import gradio as gr

        classes = self.class_choices()
        keep_s = max(1, round(self.args.keep_minutes * 60))
        # Gradio's copies of the images shown: deleted every min(keep, 5 min) once older than
        # --keep-minutes, and all at shutdown
        with gr.Blocks(title=f"nala_dit · {self.source.info.get('model') or 'model'}",
                       delete_cache=(min(keep_s, 300), keep_s)) as page:
            gr.Markdown(self.describe())
            with gr.Row():
                with gr.Column(scale=1, min_width=300):
                    pick = gr.Dropdown(classes, value=[classes[0][1]], multiselect=True, allow_custom_value=True,
                                       filterable=True, label="classes (type to search; a name or id)",
                                       elem_id="classes")
                    per_label = gr.Slider(1, min(16, self.args.max_images), value=4, step=1,
                                          label="images per class (one row each)", elem_id="per-label")
                    with gr.Row():
                        sampler = gr.Dropdown(self.samplers, value=self.default_sampler, label="sampler",
                                              elem_id="sampler")
                        steps = gr.Number(self.default_steps(self.default_sampler), precision=0, label="steps",
                                          elem_id="steps")
                    with gr.Row():
                        guidance = gr.Number(self.default_guidance(), label="guidance (1 = none)", elem_id="guidance")
                        seed = gr.Number(0, precision=0, label="seed", elem_id="seed")
                    size = gr.Dropdown(self.size_choices(), value=str(self.trained), allow_custom_value=True,
                                       label="image size (px: N or HxW)", elem_id="size")
                    go = gr.Button("Generate", variant="primary", elem_id="generate")
                with gr.Column(scale=2):
                    status = gr.HTML(status_line("pick classes, then Generate"), elem_id="status")
                    grid = gr.Image(label="grid (one row per class)", type="filepath", format="png",
                                    interactive=False, elem_id="grid", buttons=["download"], height=360)
                    gallery = gr.Gallery(label="images (open one to download it)", format="png", columns=8,
                                         elem_id="images", buttons=["download"], interactive=False, height="auto")
                    files = gr.File(label="PNG files", file_count="multiple", interactive=False, elem_id="files")
                    command = gr.Code(label="the same images from the command line", language="shell",
                                      interactive=False, elem_id="command", lines=2, wrap_lines=True,
                                      show_line_numbers=False, buttons=["copy"])

            def generate(classes, per_label, sampler, steps, guidance, seed, size, progress=gr.Progress()):
                return self.generate(classes, per_label, sampler, steps, guidance, seed, size, progress)

            sampler.change(self.default_steps, sampler, steps, queue=False)
            go.click(generate, [pick, per_label, sampler, steps, guidance, seed, size],
                     [status, grid, gallery, files, command], concurrency_limit=1, concurrency_id="sample",
                     show_progress="full")
        return page


class _ProgressBar:
    """``watch_progress`` callback → Gradio's progress bar: images done, plus the steps of the batch."""

    def __init__(self, progress, total: int, batch_size: int):
        self.progress, self.total, self.batch = progress, total, batch_size
        self.images = 0

    def __call__(self, desc: str, n: int, total) -> None:
        if self.progress is None:
            return
        if desc == "sample":
            self.images = n
            self.progress((n, self.total), desc="sampling", unit="images")
        elif desc == "steps" and total:
            batch = min(self.batch, self.total - self.images)
            self.progress((self.images + batch * n / total) / self.total,
                          desc=f"images {self.images + 1}-{self.images + batch} of {self.total}: step {n}/{total}")


def one_line(err: BaseException) -> str:
    """An exception's message on one line (the page's status line; torch's messages run on)."""
    return " ".join(str(err).split()) or type(err).__name__


class RequestGuard:
    """ASGI middleware in front of the page (Gradio's FastAPI app, ``app_kwargs``): 403 for

    * a ``Host`` header that is not a name this server listens under (``localhost``,
      ``127.0.0.1``, ``::1``, ``--host``; for ``--host 0.0.0.0`` / ``::`` also any IP address
      and this machine's names): a page on another site whose name was made to resolve to
      this machine (DNS rebinding) is refused;
    * an ``Origin`` header (sent by browsers with every POST and WebSocket) naming another
      host: another site's page cannot post requests to it;
    * Gradio's file-writing routes (``/upload``, ``/process_recording``): the page takes no
      files, so nothing is stored from outside.
    """

    REFUSED_ROUTES = ("upload", "process_recording")

    def __init__(self, app, host: str):
        self.app = app
        self.host = host.strip("[]").lower()
        self.any_address = self.host in ("0.0.0.0", "::", "")
        self.names = {"localhost", "127.0.0.1", "::1", self.host}
        if self.any_address:
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    def allowed(self, host: str | None) -> bool:
        if not host:
            return False
        name = (urlsplit(f"//{host}").hostname or "").lower()
        if name in self.names:
            return True
        if self.any_address:
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    def refused(self, scope) -> str | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if not self.allowed(headers.get("host")):
            return f"host {headers.get('host')!r} is not a name this server listens under (app.py --host)"
        origin = headers.get("origin")
        if origin is not None and not self.allowed(urlsplit(origin).netloc):
            return f"requests from pages of {origin!r} are refused"
        if scope["type"] == "http" and scope.get("method") == "POST" and \
                scope.get("path", "").rstrip("/").rsplit("/", 1)[-1] in self.REFUSED_ROUTES:
            return "this page takes no uploads"
        return None

    @staticmethod
    async def drain(receive, limit: int = 16 << 20) -> None:
        """Read and drop a refused request's body (up to ``limit`` bytes): a client still
        sending it (an upload) then reads the 403, where an unread body would have the server
        close the connection under it (a reset, no answer)."""
        seen = 0
        while seen <= limit:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            if not message.get("more_body", False):
                return

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and (why := self.refused(scope)):
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            await self.drain(receive)
            body = f"forbidden: {why}\n".encode()
            await send({"type": "http.response.start", "status": 403,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


def _number(value, default):
    """A Gradio number (float, or None when emptied) as the integer text argparse reads."""
    if value is None or value == "":
        return default
    return int(value) if float(value) == int(value) else value


def parse_sample_args(argv: list[str]) -> argparse.Namespace:
    """``sample.py``'s parser on ``argv``; its errors as a ValueError with argparse's words
    (the command would print them as ``sample.py: error: ...``)."""
    import sample

    parser = sample.build_parser()

    def error(message):
        raise ValueError(message)

    parser.error = error
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not args.keep_minutes > 0:
        print(f"error: --keep-minutes must be > 0, got {args.keep_minutes:g}", file=sys.stderr)
        return 1
    # Everything this process writes, in one folder removed at exit: the requests' images and,
    # unless GRADIO_TEMP_DIR says where, Gradio's copies of them (Gradio reads it when it builds the page).
    work = tempfile.TemporaryDirectory(prefix="nala_dit_app-")
    ours = "GRADIO_TEMP_DIR" not in os.environ
    if ours:
        os.environ["GRADIO_TEMP_DIR"] = os.path.join(work.name, "gradio")
    try:
        return serve(args, work)
    finally:
        if ours:
            os.environ.pop("GRADIO_TEMP_DIR", None)
        work.cleanup()


def serve(args, work) -> int:
    try:
        import gradio  # noqa: F401
    except ImportError:
        print("error: app.py needs gradio: pip install -e '.[demo]' (make installs it)", file=sys.stderr)
        return 1
    try:
        set_threads(args.threads)
        if args.max_images < 1 or args.batch_size < 1 or args.max_work < 1:
            raise ValueError("--max-images, --max-work and --batch-size must be >= 1")
        demo = Demo(args, load(args), work)
    except ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    page = demo.page()
    page.queue(max_size=32, default_concurrency_limit=1)
    # SIGTERM as Ctrl-C: the server closes, its cache and the folder above are removed
    signal.signal(signal.SIGTERM, _interrupt)
    page.launch(**launch_options(args), prevent_thread_lock=True)
    where = "this machine only" if args.host in ("127.0.0.1", "localhost", "::1") else f"--host {args.host}"
    print(f"app: {demo.source.info.get('model')} from {args.ckpt}; open {page.local_url} ({where}, no share link; "
          f"Ctrl-C stops it)", flush=True)
    try:   # Gradio's block_thread would print "Keyboard interruption in main thread... closing server."
        while page.is_running:
            time.sleep(0.1)
    except KeyboardInterrupt as stop:
        print(f"app: stopped ({stop or 'Ctrl-C'}); its temporary files are removed", flush=True)
    finally:
        page.close()
    return 0


def _interrupt(signum, frame):
    raise KeyboardInterrupt("SIGTERM")


def launch_options(args) -> dict:
    """``Blocks.launch`` keywords: this machine (unless --host), no share link (and, ``quiet``,
    not Gradio's lines suggesting one: ``serve`` prints the URL), no server-side rendering or
    MCP server, no uploads, ``RequestGuard`` in front, the system's fonts; small images shown
    enlarged, pixel for pixel."""
    from starlette.middleware import Middleware

    css = ("#grid img {width: 100%; height: 100%; object-fit: contain;} "
           "#grid img, #images img {image-rendering: pixelated;} .status {padding: 0.4em 0;} "
           ".status.error {color: #b91c1c; font-weight: 600;}")
    return dict(server_name=args.host, server_port=args.port or None, share=False, inbrowser=False, ssr_mode=False,
                mcp_server=False, footer_links=[], show_error=False, css=css, theme=_theme(), quiet=True,
                max_file_size=0, app_kwargs={"middleware": [Middleware(RequestGuard, host=args.host)]})


def _theme():
    """Gradio's default theme with the system's fonts: no font download (the page works offline)."""
    import gradio as gr

    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    return gr.themes.Default(font=system, font_mono=["ui-monospace", "monospace"])


if __name__ == "__main__":
    sys.exit(run_main(main))
