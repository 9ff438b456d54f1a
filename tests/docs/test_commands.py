"""Every command the repository prints or documents exists (a python, accelerate, hf, make or tar line runs)."""
import ast
import keyword
import os
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


VENV_BIN = ROOT / ".venv" / "bin"


SHELL_WORDS = {"cd", "source", ".", "export", "for", "do", "done", "if", "then", "else", "fi", "while", "echo",
               "set", "wait", "exit", "unset", "time", "exec", "env"}


# The programs a printed command may start with that are checked wherever they appear (a
# hyphenated word followed by arguments, `huggingface-cli download ...`, is checked too).
TOOLS = {"make", "source", "accelerate", "hf", "huggingface-cli", "pip", "pip3", "python", "python3", "bash", "sh",
         "tar", "torchrun", "git", "wget", "curl", "tensorboard", "wandb", "diffusers-cli", "transformers"}


WORD = re.compile(r"^(\.venv/bin/)?[A-Za-z][\w.+-]*$")


ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def exists(word: str) -> bool:
    """A program of the venv or of PATH, a repo-relative executable, a shell word, or a
    script of the repo (``train.py --help``: run by python)."""
    if word in SHELL_WORDS:
        return True
    if word.endswith(".py"):
        return (ROOT / word).is_file()
    if "/" in word:
        return (ROOT / word).exists() or Path(word).exists()
    return shutil.which(word, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}") is not None


def command_word(span: str, everything: bool) -> str | None:
    """The program a command line starts with (after ``VAR=value`` assignments and ``$ ``),
    or None when ``span`` does not read as a command (prose, math, Python)."""
    tokens = span.strip().removeprefix("$ ").split()
    while tokens and ENV.match(tokens[0]):
        tokens = tokens[1:]
    if not tokens or tokens[0].startswith("-") or not WORD.match(tokens[0]) or keyword.iskeyword(tokens[0]):
        return None
    word = tokens[0]
    if everything:                 # a shell code block: every line is a command
        return word
    if len(tokens) < 2 or word == "X":   # X: a formatted value of an f-string
        return None
    if any(t in ("=", "+=", "·", "%", "//", "→", "←") or "(" in t for t in tokens[1:3]):
        return None
    if word in TOOLS or word.startswith(".venv/bin/") or word.endswith(".py"):
        return word
    if re.match(r"^[a-z]+(-[a-z]+)+$", word) and any(re.match(r"^--?[a-z]", t) for t in tokens[1:]):
        return word                # an unknown hyphenated program with flags: huggingface-cli download ... --x
    return None


def markdown_commands(path: Path):
    """(line, first word) of each command line in a shell (or unlabelled) code block."""
    fence, heredoc, continued = None, None, False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if heredoc is not None:
            heredoc = None if stripped == heredoc else heredoc
            continue
        if stripped.startswith("```"):
            fence = None if fence is not None else stripped[3:].strip()
            continue
        if fence not in ("bash", "sh", "shell", "console", ""):
            continue
        if continued or not stripped or stripped.startswith("#"):
            continued = continued and stripped.endswith("\\")
            continue
        continued = stripped.endswith("\\")
        if match := re.search(r"<<-?\s*'?\"?(\w+)", stripped):
            heredoc = match.group(1)
        if word := command_word(stripped, everything=True):
            yield number, word


def python_strings(path: Path):
    """(line, text) of every string literal; an f-string's fields read as ``X``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def python_commands(path: Path):
    """(line, first word) of the commands in a file's strings: quoted spans (`...` or
    ``...``) and, in the top-level CLIs' texts, indented example lines."""
    for number, text in python_strings(path):
        spans = [a or b for a, b in re.findall(r"``(.+?)``|`([^`\n]+)`", text)]
        if path.parent == ROOT:
            spans += [line.strip() for line in text.splitlines() if line.startswith("    ")]
        for span in spans:
            if word := command_word(span, everything=False):
                yield number, word


def all_commands():
    found = []
    for path in sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]:
        found += [(f"{path.relative_to(ROOT)}:{n}", w) for n, w in markdown_commands(path)]
    for path in sorted((ROOT / "nala_dit").rglob("*.py")) + sorted(ROOT.glob("*.py")):
        found += [(f"{path.relative_to(ROOT)}:{n}", w) for n, w in python_commands(path)]
    return found


def test_the_command_finder_sees_what_it_must():
    words = {w for _, w in all_commands()}
    assert {"python", "accelerate", "make", "hf", ".venv/bin/python"} <= words
    assert command_word("huggingface-cli download x --local-dir y", everything=False) == "huggingface-cli"
    assert command_word("o = W v", everything=False) is None and command_word("import nala_dit", False) is None


def test_every_printed_or_documented_command_exists():
    missing = [f"{where}: {word}" for where, word in all_commands() if not exists(word)]
    assert not missing, "commands that do not exist here:\n" + "\n".join(missing)


def test_offline_advice_names_hf_download_not_huggingface_cli():
    for path in [*(ROOT / "docs").glob("*.md"), ROOT / "README.md", *(ROOT / "nala_dit").rglob("*.py"),
                 *ROOT.glob("*.py")]:
        assert "huggingface-cli" not in path.read_text(), path
    from nala_dit.models.vae import download_advice

    assert "`hf download stabilityai/sd-vae-ft-ema --local-dir sd-vae-ft-ema`" in download_advice(
        "stabilityai/sd-vae-ft-ema")
