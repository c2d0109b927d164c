"""Load a JobConfig from YAML or Python, apply key=value overrides, and word errors for users."""

from __future__ import annotations

import difflib
import runpy
import sys
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from relax_launch.config.errors import ConfigError
from relax_launch.config.job import JobConfig


def load_config(path: str | Path, overrides: typing.Sequence[str] = ()) -> JobConfig:
    """Read a job from a ``.yaml``/``.yml`` file or a ``.py`` file defining ``config``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist.")
    if path.suffix in (".yaml", ".yml"):
        raw = _read_yaml(path)
    elif path.suffix == ".py":
        raw = _read_python(path)
    else:
        raise ConfigError(f"config file {path}: expected a .yaml, .yml or .py file.")
    return build_config(raw, overrides, source=str(path))


def build_config(
    raw: dict[str, Any], overrides: typing.Sequence[str] = (), source: str = "config"
) -> JobConfig:
    """Validate a plain mapping (after overrides) into a JobConfig, or raise ConfigError."""
    data = apply_overrides(raw, overrides)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise config_error_from(exc, source) from None


def with_overrides(config: JobConfig, overrides: typing.Sequence[str]) -> JobConfig:
    """A copy of ``config`` with ``key.sub=value`` overrides applied and validated again."""
    return build_config(config.model_dump(exclude_unset=True), overrides)


def apply_overrides(raw: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides (value parsed as YAML) to a copy of ``raw``."""
    data = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.isidentifier() or p.isdigit() for p in parts):
            raise ConfigError(
                f"override {item!r} must look like section.field=value, e.g. rollout.ranks=2."
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        _set_path(data, parts, value, item)
    return data


def config_error_from(exc: ValidationError, source: str) -> ConfigError:
    """Turn pydantic's errors into one ConfigError naming every dotted path at fault."""
    lines, fields = [], []
    for err in exc.errors():
        path = _dotted(err["loc"])
        fields.append(path or "(job)")
        lines.append(f"  {path + ': ' if path else ''}{_describe(err)}")
    return ConfigError(f"{source} is not a valid job:\n" + "\n".join(lines), tuple(fields))


def _describe(err: Any) -> str:
    loc, kind = tuple(err["loc"]), err["type"]
    if kind == "extra_forbidden":
        known = list(_model_at(loc[:-1]).model_fields) if _model_at(loc[:-1]) else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"
        return f"unknown field; {hint}"
    if kind == "missing":
        parent = _model_at(loc[:-1])
        field = parent.model_fields.get(str(loc[-1])) if parent else None
        return "required" + (f": {field.description}" if field and field.description else "")
    msg = err["msg"].removeprefix("Value error, ")
    if kind not in ("value_error", "assertion_error") and "input" in err:
        msg += f" (got {err['input']!r})"
    return msg


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class found by walking ``loc`` down from JobConfig."""
    model: Any = JobConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if _is_model(model) else None
        if field is None:
            return None
        model = _inner_model(field.annotation)
    return model if _is_model(model) else None


def _inner_model(annotation: Any) -> Any:
    """The model class inside ``X``, ``X | None`` or ``tuple[X, ...]``, else None."""
    if _is_model(annotation):
        return annotation
    return next(filter(None, map(_inner_model, typing.get_args(annotation))), None)


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _dotted(loc: typing.Iterable[Any]) -> str:
    return ".".join(str(p) for p in loc)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path} must hold a mapping of sections (cluster:, trainer:, ...).")
    return raw


def _read_python(path: Path) -> dict[str, Any]:
    """Run a Python config (its folder importable, for shared helpers) and take ``config``."""
    sys.path.insert(0, str(path.resolve().parent))
    try:
        namespace = runpy.run_path(str(path))
    except ValidationError as exc:
        raise config_error_from(exc, str(path)) from None
    except Exception as exc:  # noqa: BLE001 - user code: report it as a config error, no traceback
        raise ConfigError(f"{path} failed to run: {type(exc).__name__}: {exc}") from None
    finally:
        sys.path.remove(str(path.resolve().parent))
    config = namespace.get("config")
    if not isinstance(config, JobConfig):
        raise ConfigError(f"{path} must define `config = JobConfig(...)` at module level.")
    return config.model_dump(exclude_unset=True)


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_deep_copy(v) for v in value]
    return value


def _set_path(data: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        key: Any = int(part) if isinstance(node, list) else part
        child = node[key] if _has(node, key) else None
        if child is None:
            child = {}
            _put(node, key, child, item)
        if not isinstance(child, dict | list):
            where = ".".join(parts[: i + 1])
            raise ConfigError(f"override {item!r}: {where} is a value, not a section.")
        node = child
    _put(node, int(parts[-1]) if isinstance(node, list) else parts[-1], value, item)


def _has(node: Any, key: Any) -> bool:
    return key in node if isinstance(node, dict) else 0 <= key < len(node)


def _put(node: Any, key: Any, value: Any, item: str) -> None:
    if isinstance(node, list) and not (isinstance(key, int) and 0 <= key < len(node)):
        raise ConfigError(f"override {item!r}: list index {key} is out of range.")
    node[key] = value
