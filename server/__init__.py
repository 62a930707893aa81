"""The FastAPI service: control plane, chunk data plane, metrics."""
