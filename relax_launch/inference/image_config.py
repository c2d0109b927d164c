"""The config section of the images requests may carry (``gateway.images``); the policy that
applies it is ``images.py``."""

from __future__ import annotations

from pathlib import PurePosixPath

from pydantic import Field, field_validator

from relax_launch.config.section import Section


class ImageLimits(Section):
    """Images external callers and user code (an agentic tool) may send; not the dataset's."""

    allowed_dirs: tuple[str, ...] = Field(
        (),
        description="Absolute directories whose image files requests may name (file:// URL or "
        "absolute path; read by the gateway and sent as data); each must exist when the job "
        "starts (preflight). Empty: data: URLs only.",
    )
    max_bytes: int = Field(
        8 * 2**20,
        ge=1,
        description="Largest image file, bytes (decoded); gateway.max_body_bytes bounds the "
        "request (base64 is 4/3 of the bytes).",
    )
    max_images: int = Field(
        8,
        ge=1,
        description="Most images in one request. An agentic turn with images a tool made counts "
        "all its images, the prompt's too (so only a tool's can take it past this).",
    )
    max_pixels: int = Field(4096 * 4096, ge=1, description="Largest image, width x height pixels.")

    @field_validator("allowed_dirs")
    @classmethod
    def _directories(cls, dirs: tuple[str, ...]) -> tuple[str, ...]:
        for entry in dirs:
            if not PurePosixPath(entry).is_absolute():
                raise ValueError(f"{entry!r} is not an absolute path: give the directory's")
        return dirs
