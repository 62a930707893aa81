"""Render the service's OpenAPI schema as the Markdown API reference (docs/api.md).

``python -m kvtier.server.openapi_doc > docs/api.md`` regenerates it; a test fails when the
committed file no longer matches the code.
"""

from __future__ import annotations

import json
import tempfile
from typing import Any

HEADER = """# HTTP API reference

Generated from the OpenAPI schema of `kvtier serve` by
`python -m kvtier.server.openapi_doc > docs/api.md` (a test keeps it current). A running
server also serves the schema at `/openapi.json` and interactive docs at `/docs`. How to use
the service, the client and the metrics: [server.md](server.md).

Every error has the body `{"error": {"type": ..., "message": ..., "code": <status>}}`.
"""


def _schema_name(schema: dict[str, Any]) -> str:
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if schema.get("type") == "array":
        return f"list of {_schema_name(schema.get('items', {}))}"
    if "anyOf" in schema:
        return " or ".join(_schema_name(s) for s in schema["anyOf"])
    fmt = schema.get("format")
    return schema.get("type", "object") + (f" ({fmt})" if fmt else "")


def _params(op: dict[str, Any]) -> list[str]:
    rows = []
    for p in op.get("parameters", []):
        schema = p.get("schema", {})
        extra = f", pattern `{schema['pattern']}`" if "pattern" in schema else ""
        if "anyOf" in schema:
            pats = [s["pattern"] for s in schema["anyOf"] if "pattern" in s]
            extra = f", pattern `{pats[0]}`" if pats else ""
        req = "required" if p.get("required") else "optional"
        desc = p.get("description") or schema.get("description") or ""
        rows.append(f"- `{p['name']}` ({p['in']}, {req}{extra}) {desc}".rstrip())
    return rows


def render(openapi: dict[str, Any]) -> str:
    out = [HEADER]
    for path, ops in openapi["paths"].items():
        for method, op in ops.items():
            out.append(f"\n## `{method.upper()} {path}`\n")
            doc = (op.get("description") or op.get("summary") or "").strip()
            if doc:
                out.append(doc + "\n")
            params = _params(op)
            if params:
                out.append("Parameters:\n\n" + "\n".join(params) + "\n")
            body = op.get("requestBody")
            if body:
                kinds = ", ".join(
                    f"`{ct}` {_schema_name(c.get('schema', {}))}"
                    for ct, c in body.get("content", {}).items()
                )
                out.append(f"Body: {kinds}\n")
            lines = []
            for status, resp in op.get("responses", {}).items():
                content = resp.get("content", {})
                kinds = ", ".join(
                    f"`{ct}`" + (f" {_schema_name(c['schema'])}" if c.get("schema") else "")
                    for ct, c in content.items()
                )
                lines.append(f"- {status}: {resp.get('description', '')} {kinds}".rstrip())
            out.append("Responses:\n\n" + "\n".join(lines) + "\n")
    out.append("\n## Schemas\n")
    for name, schema in openapi.get("components", {}).get("schemas", {}).items():
        props = schema.get("properties", {})
        if not props:
            continue
        out.append(f"\n### {name}\n")
        if schema.get("description"):
            out.append(schema["description"].strip() + "\n")
        required = set(schema.get("required", []))
        for prop, ps in props.items():
            mark = "" if prop in required else " (optional)"
            desc = f": {ps['description']}" if ps.get("description") else ""
            out.append(f"- `{prop}` {_schema_name(ps)}{mark}{desc}")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def current_schema() -> dict[str, Any]:
    """The schema of an engine-mode app (the superset of routes), built without a model."""
    from kvtier.config import load_config
    from kvtier.server.app import create_app
    from kvtier.server.state import ServiceState

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            environ={}, overrides={"tiers": {"cpu_bytes": 0, "disk_dir": tmp, "disk_bytes": 1 << 20}}
        )
        state = ServiceState.sidecar(cfg)
        try:
            return json.loads(json.dumps(create_app(state).openapi()))
        finally:
            state.close()


if __name__ == "__main__":  # pragma: no cover
    print(render(current_schema()), end="")
