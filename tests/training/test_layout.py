"""The training package's shape: the loop module reads like EDM2's
``training_loop.py`` (construction, the loop, one step), its construction and the resume
policy in short functions of their own modules, and no function in ``training/`` longer
than a screen and a half."""

import ast
from pathlib import Path

TRAINING = Path(__file__).resolve().parents[2] / "nala_dit" / "training"
LOOP_LINES = 350            # EDM2's whole training_loop.py: 244; DiT's train.py: 269
SCREEN = 60                 # the run's construction, the resume policy and one step: each on one screen
MAX_FUNCTION_LINES = 80     # any function of the package


def _functions(path: Path):
    """(qualified name, lines from ``def`` to its last line) of every function in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                yield f"{path.name}:{owner}{child.name}", child.end_lineno - child.lineno + 1


def test_no_function_in_training_is_longer_than_80_lines():
    long = [f"{name} ({n} lines)" for path in sorted(TRAINING.glob("*.py")) for name, n in _functions(path)
            if n > MAX_FUNCTION_LINES]
    assert long == []


def test_the_loop_its_construction_and_the_resume_policy_fit_on_a_screen():
    assert len((TRAINING / "loop.py").read_text().splitlines()) <= LOOP_LINES
    long = [f"{name} ({n} lines)" for module in ("loop.py", "build.py", "resume.py", "run.py")
            for name, n in _functions(TRAINING / module) if n > SCREEN]
    assert long == []
    names = {name for name, _ in _functions(TRAINING / "loop.py")}
    assert {"loop.py:build_run", "loop.py:train_loop", "loop.py:TrainStep.__call__"} <= names
    resume = {name.split(":")[1] for name, _ in _functions(TRAINING / "resume.py")}
    assert {"find_resume", "restore", "resume_run", "resumed_position", "resume_announcements"} <= resume


def test_run_is_built_by_keywords():
    """``Run`` has two dozen fields: a positional call would bind them by their order."""
    calls = [node for path in TRAINING.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Run"]
    assert calls, "build_run builds the Run"
    assert all(not call.args for call in calls)


def test_the_resume_rules_are_trainings_and_torch_free():
    """``cli/options.py`` names the rules ``training/resume_rules.py`` owns (the same objects),
    and that module imports nothing heavy, so ``train.py --help`` stays instant."""
    from nala_dit.cli import options
    from nala_dit.training import resume_rules

    assert options.RESUME_RULES is resume_rules.RESUME_RULES and options.RESUME_NOTES is resume_rules.RESUME_NOTES
    tree = ast.parse((TRAINING / "resume_rules.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    assert imported <= {"__future__", "attention.config"}, imported


MAX_PARAMETERS = 7          # the set-up passes bundles (run.py: Placement, Space, Weights, Logs), not long lists
# Plain values or keyword-only settings, each named at the call: a message's parts, a checkpoint's files
MANY_PARAMETERS = {"build.py:start_line", "checkpoint.py:save_checkpoint", "sharding.py:Sharding.save"}


def _parameters(path: Path):
    """(qualified name, parameters less self/cls) of every function in ``path``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                owner = f"{node.name}." if isinstance(node, ast.ClassDef) else ""
                args = child.args
                names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
                yield f"{path.name}:{owner}{child.name}", len([n for n in names if n not in ("self", "cls")])


def test_training_plumbing_passes_bundles_not_long_argument_lists():
    """Before the bundles: step_model took 9 arguments, build_evaluations 14, resume_run 11,
    SampleGrid 11, EpochBatches 9, HeldOutLoss 10, and Run had 20 fields."""
    import dataclasses

    from nala_dit.training.run import Run

    long = {name: n for path in sorted(TRAINING.glob("*.py")) for name, n in _parameters(path)
            if n > MAX_PARAMETERS and name not in MANY_PARAMETERS}
    assert long == {}
    assert len(dataclasses.fields(Run)) == 15
