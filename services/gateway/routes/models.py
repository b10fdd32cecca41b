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
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "vllm-backport",
            "max_model_len": model.max_model_len}


# HEAD too: some load balancers probe with it.
@router.api_route("/health", methods=["GET", "HEAD"])
async def health(request: Request) -> JSONResponse:
    """200 while a request sent now could be served; otherwise 503 with the reason, so a load
    balancer sends traffic to another replica."""
    backend = backend_of(request)
    if request.app.state.draining:
        return _unavailable("the gateway is shutting down")
    if backend.model is None:
        return _unavailable("the gateway is still connecting to the mesh")
    if not backend.pool.routable():
        return _unavailable("no engine is serving")
    return JSONResponse({"status": "ok"})


def _unavailable(reason: str) -> JSONResponse:
    return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
