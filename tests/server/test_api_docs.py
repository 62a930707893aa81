"""docs/api.md is the rendering of the service's current OpenAPI schema."""

from __future__ import annotations

from pathlib import Path

from kvtier.server.openapi_doc import current_schema, render

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def test_api_reference_is_current():
    assert DOC.read_text() == render(current_schema()), (
        "docs/api.md is stale: run `python -m kvtier.server.openapi_doc > docs/api.md`"
    )
