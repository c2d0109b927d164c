"""Generate docs/configuration.md from the schema: every field, its type, default and meaning.

Run ``python -m relax_launch.config.reference > docs/configuration.md``; a test keeps the
checked-in file equal to this output.
"""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from relax_launch.config.job import JobConfig

HEADER = """# Configuration reference

Generated from the schema by `python -m relax_launch.config.reference`; do not edit by hand.

A job is one YAML file (or a Python file defining `config = JobConfig(...)`) with the sections
below. Unknown keys are errors that name their dotted path. Any field can be overridden on the
command line as `section.field=value` (the value is parsed as YAML: `rollout.ranks=2`,
`teacher=null`, `rollout.engine.max_total_tokens=4096`, `reward.sources.0.weight=0.5`).
"""


def _type_name(annotation: typing.Any) -> str:
    text = str(annotation).replace("typing.", "")
    for prefix in ("<class '", "'>"):
        text = text.replace(prefix, "")
    text = re.sub(r"\b[a-z_]\w*\.", "", text.replace("NoneType", "None"))
    return text.replace("|", "\\|")


def _default(field: typing.Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default if field.default_factory is None else field.default_factory()
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, tuple) and value and isinstance(value[0], BaseModel):
        return "`" + repr([v.model_dump(exclude_defaults=True) for v in value]) + "`"
    return f"`{value!r}`"


def _section_model(annotation: typing.Any) -> type[BaseModel] | None:
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _table(model: type[BaseModel]) -> list[str]:
    rows = ["| field | type | default | description |", "|---|---|---|---|"]
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        kind = _type_name(field.annotation)
        rows.append(f"| `{name}` | `{kind}` | {_default(field)} | {description} |")
    return rows


def render_reference() -> str:
    """The whole reference as Markdown."""
    lines = [HEADER, "## Top level", "", *_table(JobConfig), ""]
    for name, field in JobConfig.model_fields.items():
        model = _section_model(field.annotation)
        if model is None:
            continue
        lines += [f"## `{name}`", "", (model.__doc__ or "").strip(), "", *_table(model), ""]
        lines += _sections_within(name, model, depth=3)
    return "\n".join(lines).rstrip() + "\n"


def _sections_within(path: str, model: type[BaseModel], depth: int) -> list[str]:
    """A heading and table for each section among ``model``'s fields, and for theirs."""
    lines = []
    for sub_name, sub_field in model.model_fields.items():
        sub_model = _section_model(sub_field.annotation)  # X, X | None, tuple[X, ...]
        if sub_model is not None:
            is_list = typing.get_origin(sub_field.annotation) in (tuple, list)
            title = f"{path}.{sub_name}" + ("[]" if is_list else "")
            lines += [f"{'#' * depth} `{title}`", "", (sub_model.__doc__ or "").strip(), ""]
            lines += [*_table(sub_model), ""]
            lines += _sections_within(title, sub_model, depth + 1)
    return lines


if __name__ == "__main__":
    print(render_reference(), end="")
