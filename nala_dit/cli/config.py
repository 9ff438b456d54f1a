"""Configs whose keys are the CLI flags: defaults < YAML file < command line.

A config is a dataclass. Each field ``global_batch_size`` is the flag
``--global-batch-size`` and the YAML key ``global-batch-size`` (exactly the flag without
its dashes). An unknown YAML key or a mistyped flag is an error with a suggestion, never
silently ignored (a SiT complaint); prefix abbreviations are off for the same reason,
in every CLI (``parse.py``). The resolved config is a plain dict that goes into every checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from ..checks import read_text, too_many_digits
from ..training.config import dump_yaml, flag_name, to_dict  # noqa: F401  (a run's config as stored)
from .parse import ArgumentParser, closest


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(the scalar type, whether None is allowed) of a field annotation."""
    if isinstance(annotation, str):
        annotation = eval(annotation, {"typing": typing}, {})  # dataclass string annotations
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], True
    return annotation, False


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxtuple, _SHOWN.maxdict = 2, 4, 4, 4
_SHOWN.maxstring = _SHOWN.maxother = 60
_SHOWN.maxlong = 40


def shown(value) -> str:
    """``repr(value)`` for an error message, at most about 80 characters, computed without
    walking all of a huge value (a YAML alias bomb's nested lists)."""
    text = _SHOWN.repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _parse_value(text: str, typ: type, optional: bool, name: str):
    if optional and text.lower() in ("none", "null"):
        return None
    if typ is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"--{name} expects true/false, got {shown(text)}")
    try:
        return typ(text)
    except ValueError:  # argparse would say "invalid <lambda> value"
        what = {int: "an integer", float: "a number"}.get(typ, typ.__name__)
        example = {"image_size": ", e.g. 256 (pixels per side)"}.get(name.replace("-", "_"), "")
        raise argparse.ArgumentTypeError(f"--{name} expects {what}{example}, got {shown(text)}") from None


def _parse_choice(text: str, choices, name: str) -> str:
    """A choice flag's value, checked by argparse against ``choices`` after this. Only
    ``none`` / ``null`` need care: they are the choice ``none`` where there is one
    (``--pos-embed none``), else an error naming the choices (argparse would answer
    "invalid choice: None", a value the user never typed)."""
    if text in choices or text.lower() not in ("none", "null"):
        return text
    if "none" in choices:
        return "none"
    listed = ", ".join(map(repr, choices))
    hint = CHOICE_HINTS.get(name.replace("-", "_"), "")
    raise argparse.ArgumentTypeError(f"--{name} expects one of {listed}, got {shown(text)}{hint}")


# What a value outside a flag's choices may have meant.
CHOICE_HINTS = {"mlp": " (every block has an MLP: 'mlp' is DiT's, the default; 'mix' is Mix-FFN, a 3x3 depthwise "
                       "conv between its linears)"}


def build_parser(cls, description: str | None = None, epilog: str | None = None) -> argparse.ArgumentParser:
    """An argparse parser with one flag per dataclass field (help from field metadata).

    A config class with ``help_common`` (field names) and ``help_sections`` ((title, first
    field) pairs, in field order) gets a short ``--help`` of the common flags and ``--help-all``
    with every flag under its section's title (``TrainConfig``: train.py)."""
    common = getattr(cls, "help_common", None)
    parser = ArgumentParser(description=description, epilog=epilog, add_help=common is None,
                            usage="%(prog)s [--config FILE.yaml] [options]" if common is not None else None)
    if common is not None:
        parser.add_help_flags()
    picked = parser.common_actions if common is not None else []
    picked.append(parser.add_argument("--config", type=Path, default=None, metavar="FILE.yaml",
                                      help="YAML file whose keys are these flags (without the leading --)"))
    picked.append(parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit"))
    sections = dict((first, title) for title, first in getattr(cls, "help_sections", ()))
    group = parser
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if field.name in sections:
            group = parser.add_argument_group(sections[field.name])
        typ, optional = _base_type(hints[field.name])
        name = flag_name(field.name)
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        # A help that explains its own default, or a None default ("not set": the preset's,
        # the path's...), gets no "(default: ...)" of its own.
        text = field.metadata.get("help", "")
        shown = default is not None and "default" not in text
        kwargs = dict(dest=field.name, default=argparse.SUPPRESS, help=f"{text} (default: {default})" if shown else text)
        if "choices" in field.metadata:
            kwargs["choices"] = field.metadata["choices"]
            kwargs["type"] = lambda s, c=tuple(field.metadata["choices"]), n=name: _parse_choice(s, c, n)
        elif typ is bool:
            kwargs["type"] = lambda s, n=name: _parse_value(s, bool, False, n)
            kwargs["nargs"] = "?"
            kwargs["const"] = True
            kwargs["metavar"] = "BOOL"
        else:
            kwargs["type"] = lambda s, t=typ, o=optional, n=name: _parse_value(s, t, o, n)
        if "metavar" in field.metadata:
            kwargs["metavar"] = field.metadata["metavar"]
        action = group.add_argument(f"--{name}", **kwargs)
        if common is not None and field.name in common:   # --help: the field's brief help, where it has one
            picked.append(_briefly(action, field.metadata.get("brief")))
    return parser


def _briefly(action: argparse.Action, brief: str | None) -> argparse.Action:
    """``action`` as the short ``--help`` shows it: a copy with the brief help (the parser keeps
    the original, which ``--help-all`` shows)."""
    if brief is None:
        return action
    import copy

    shown = copy.copy(action)
    shown.help = brief
    return shown


def yaml_problem(err: "yaml.YAMLError") -> str:
    """One line for a YAML file that ``safe_load`` refused: a ``!!python/...`` tag (an
    object to build, never built) or a syntax error, with its line."""
    mark = getattr(err, "problem_mark", None)
    where = f"line {mark.line + 1}: " if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if problem.startswith(("the alias ", "the key ")):  # ConfigLoader's own refusals, already one line
        return where + problem
    tag = re.search(r"tag '([^']+)'", problem)
    if isinstance(err, yaml.constructor.ConstructorError) and tag:
        shown = re.sub(r"^tag:yaml\.org,2002:", "!!", tag.group(1))
        return (f"{where}the tag {shown} is refused: a config holds plain values (numbers, strings, "
                f"true/false, lists), never Python objects; write the value itself")
    return f"{where}not valid YAML ({problem})"


class ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` read the way a config means it (YAML 1.2's core rules where 1.1
    surprises):

    * ``2e-3``, ``1e5`` are numbers (YAML 1.1 wants ``2.0e-3`` and reads ``2e-3`` as a string);
    * only ``true`` / ``false`` are booleans: ``no``, ``yes``, ``on``, ``off`` stay words, so
      ``mixed-precision: no`` is the choice ``no`` (a bool flag still takes them: ``check_types``);
    * a key given twice is an error naming it (YAML would keep the last one silently);
    * an alias (``*name``) of a list or mapping is refused: a config holds plain values,
      and nested aliases expand exponentially (a 380-byte file, hundreds of MB).
    """


ConfigLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                   list("tTfF"))
ConfigLoader.add_implicit_resolver(  # e-notation YAML 1.1 reads as strings (2e-3, 1e5, 1.5e3: no dot or no sign)
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _compose_alias_refused(self, parent, index):
    if self.check_event(yaml.AliasEvent):
        event = self.peek_event()
        node = self.anchors.get(event.anchor)
        if isinstance(node, (yaml.SequenceNode, yaml.MappingNode)):
            raise yaml.composer.ComposerError(
                None, None, f"the alias *{shown(event.anchor)[1:-1]} of a list or mapping is refused (a config "
                f"holds plain values; write the value itself)", event.start_mark)
    return yaml.composer.Composer.compose_node(self, parent, index)


def _construct_mapping_once(self, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
        key = self.construct_object(key_node, deep=deep)
        if isinstance(key, str) and key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"the key {shown(key)} is given twice (lines {seen[key] + 1} and "
                f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
        if isinstance(key, str):
            seen[key] = key_node.start_mark.line
    return yaml.SafeLoader.construct_mapping(self, node, deep=deep)


ConfigLoader.compose_node = _compose_alias_refused
ConfigLoader.construct_mapping = _construct_mapping_once


def load_yaml(path: Path, cls) -> dict:
    """Read a YAML config (``ConfigLoader``'s rules), check every key is a flag of ``cls``;
    returns field-name keys."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    text = read_text(path, "a config is a YAML text file of flag: value lines")
    try:
        data = yaml.load(text, Loader=ConfigLoader) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"{path}: {yaml_problem(err)}") from None
    except ValueError as err:   # int() of a number past Python's digit limit (4,300 by default)
        if (problem := too_many_digits(err)) is None:
            raise
        raise ValueError(f"{path}: {problem}") from None
    except RecursionError:  # the parser recurses per level: a 100,000-deep list
        raise ValueError(f"{path}: nested too deeply to read (lists or mappings inside each other thousands of "
                         f"levels deep); a config holds plain values and short lists") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a config must be a mapping of flag: value, got {type(data).__name__}")
    flags = {flag_name(f.name): f.name for f in dataclasses.fields(cls)}
    unknown = []   # every unknown key in the one line, not only the first
    for key in data:
        if key not in flags:
            close = closest(str(key), list(flags))
            unknown.append(f"unknown key {shown(key)}{f' (did you mean {close[0]!r}?)' if close else ''}")
    if unknown:
        listed = "; ".join(unknown[:10]) + (f"; … ({len(unknown)} unknown keys in all)" if len(unknown) > 10 else "")
        raise ValueError(f"{path}: {listed} (keys are the CLI flags without --)")
    return {flags[key]: value for key, value in data.items()}


def check_types(cfg) -> None:
    """YAML gives ints where floats are meant etc.: coerce numbers, reject nonsense."""
    hints = typing.get_type_hints(type(cfg))
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        typ, optional = _base_type(hints[field.name])
        name = flag_name(field.name)
        if value is None:
            if not optional:
                raise ValueError(f"{name} may not be empty")
            continue
        if typ is bool and isinstance(value, str) and value.lower() in ("yes", "no", "on", "off"):
            value = _parse_value(value, bool, False, name)  # YAML 1.1's booleans, still fine for a bool flag
            setattr(cfg, field.name, value)
        elif typ is float and isinstance(value, int) and not isinstance(value, bool):
            setattr(cfg, field.name, float(value))
        elif typ is int and isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
            value = int(value)  # max-steps: 1e5
            setattr(cfg, field.name, value)
        elif typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)  # a number in YAML for a field that also takes words (norm-scale)
            setattr(cfg, field.name, value)
        elif typ is str and field.metadata.get("comma_list") and isinstance(value, list) \
                and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in value):
            value = ",".join(map(str, value))  # softmax-blocks: [1, 3], as model configs store it
            setattr(cfg, field.name, value)
        elif typ in (int, float, str, bool) and (not isinstance(value, typ)
                                                 or (typ is not bool and isinstance(value, bool))):  # max-steps: true
            raise ValueError(f"{name} must be {typ.__name__}, got {shown(value)}")
        if "choices" in field.metadata and value not in field.metadata["choices"]:
            raise ValueError(f"{name} must be one of {field.metadata['choices']}, got {shown(value)}")


def resolve(cls, argv: list[str] | None = None, description: str | None = None, epilog: str | None = None):
    """Parse the command line: defaults < ``--config`` YAML < flags. Returns (cfg, args)."""
    parser = build_parser(cls, description, epilog)
    args = parser.parse_args(argv)
    values = {}
    if args.config is not None:
        try:
            values.update(load_yaml(args.config, cls))
        except (ValueError, FileNotFoundError) as err:
            parser.error(str(err))
    values.update({k: v for k, v in vars(args).items() if k not in ("config", "dry_run")})
    cfg = cls(**values)
    try:
        check_types(cfg)
        if hasattr(cfg, "validate"):
            cfg.validate()
    except ValueError as err:
        parser.error(str(err))
    return cfg, args
