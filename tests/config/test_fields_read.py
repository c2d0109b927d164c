"""Every config field is read by the code it configures: a field nobody reads is a silent knob.

A field counts as read when some module outside the schema (``relax_launch/config/`` and the
per-package ``config.py`` section modules), preflight validation and rendering accesses an
attribute of that name. Names that are also common attributes elsewhere (``name``, ``model``) pass
trivially; the check exists for the distinctive ones, where a dropped reader is caught.
"""

from __future__ import annotations

import ast
from pathlib import Path

from pydantic import BaseModel

from relax_launch.config import JobConfig

PACKAGE = Path(__file__).resolve().parents[2] / "relax_launch"
SCHEMA_OR_VALIDATION = ("config/", "placement/preflight.py", "placement/render.py")

# Fields read only through a generic mechanism the attribute scan cannot see, with the reason.
READ_INDIRECTLY = {
    "rollout": "reached with the other roles through JobConfig.inference_roles()",
}


def section_fields(model: type[BaseModel], prefix: str = "") -> dict[str, str]:
    """``{dotted.path: field_name}`` of every leaf field of a section, recursively."""
    fields = {}
    for name, info in model.model_fields.items():
        annotation = info.annotation
        nested = [
            a
            for a in (getattr(annotation, "__args__", None) or (annotation,))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        fields[prefix + name] = name
        for section in nested:
            fields.update(section_fields(section, f"{prefix}{name}."))
    return fields


def attributes_read() -> set[str]:
    """Attribute names accessed (or passed to getattr) anywhere outside schema and validation."""
    read = set()
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(SCHEMA_OR_VALIDATION) or relative.endswith("/config.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                read.add(node.attr)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr":
                if len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    read.add(node.args[1].value)
    return read


def test_every_config_field_is_read_outside_the_schema():
    read = attributes_read()
    unread = sorted(
        path
        for path, name in section_fields(JobConfig).items()
        if name not in read and path not in READ_INDIRECTLY
    )
    assert not unread, (
        f"config fields read by no code outside the schema: {unread}. Make the code it "
        "configures read it, or delete the field (a field that is accepted must act)."
    )


def test_the_scan_finds_a_field_that_nobody_reads():
    class Probe(BaseModel):
        never_read_by_anything_xyz: int = 0

    fields = section_fields(Probe)
    assert set(fields.values()) - attributes_read() == {"never_read_by_anything_xyz"}
