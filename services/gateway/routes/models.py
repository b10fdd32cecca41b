"""GET /v1/models and GET /health."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.backend import ServedModel
from services.gateway.requests import backend_of, check_model

router = APIRouter(tags=["models"])


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_object(backend_of(request).served_model())]}


@router.get("/v1/models/{name:path}")
async def retrieve_model(name: str, request: Request) -> dict[str, Any]:
    return _model_object(check_model(backend_of(request), name))


def _model_object(model: ServedModel) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": 0, "owned_by": "vllm-backport",
            "max_model_len": model.max_model_len}


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    backend = backend_of(request)
    if backend.model is None or request.app.state.draining:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})
